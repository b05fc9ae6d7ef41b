"""AdamW vs AdEMAMix vs Muon on a small language-modeling run: loss after equal steps and equal wall time.

Each optimizer trains the same tiny Qwen2 (same initialization) on the same batches of character-level
text for the same number of steps; the runs are interleaved step by step, so load from other processes
on the shared cores hits all of them alike. The text is the Python reference documentation that ships
with the standard library (``pydoc_data.topics``, ~465k characters, lower-cased and mapped onto the tiny
model's character vocabulary); every tenth topic is held out. Reported per optimizer:

- at equal steps: train and held-out loss (nats per character, on fixed windows) after ``steps`` steps;
- at equal wall time: the same losses at the time the fastest optimizer needed for all its steps (the
  others have done fewer steps by then). Time counts training only (forward, backward, clip, step), not
  the evaluations;
- the optimizer step's own cost, which is where Muon's Newton-Schulz iterations show.

By default one learning rate serves all three (``optim.lr``): Moonlight's RMS matching is meant to let
Muon reuse AdamW's, and AdEMAMix's authors reuse AdamW's too. ``lrs=[...]`` runs a sweep and adds each
optimizer's best; compare optimizers at their own best lr before concluding anything. AdEMAMix's
warm-ups default to the run's length, as its paper does. Training runs on one thread (``threads``)
because the machine's two cores are shared: with two threads, another process on one core slows every
step many times over (FACTS.md).

    tidal bench optimizers [--set steps=300] [--set optim.lr=1e-3] [--set "optimizers=[adamw, muon]"]
                           [--set "lrs=[1e-3, 1e-2]"]

Writes a PNG of the loss curves next to the JSON (``benchmarks/results/optimizers.png``).
"""

import copy
import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.optim import OptimConfig, build_optimizer

DESCRIPTION = "AdamW vs AdEMAMix vs Muon: char-level LM loss after equal steps and equal wall time"


@dataclass
class BenchConfig:
    """What ``--set`` can change (``optim.*`` is the shared OptimConfig; ``optim.name`` is set per run)."""

    optimizers: list[str] = field(default_factory=lambda: ["adamw", "ademamix", "muon"])
    steps: int = 100
    """Optimizer steps for every optimizer (~2 minutes for the three on one core, more when it is busy)."""
    batch_size: int = 16
    seq_len: int = 64
    eval_every: int = 10
    """Steps between evaluations; also the resolution of the equal-wall-time comparison."""
    eval_windows: int = 48
    """Fixed windows of ``seq_len`` characters for each of the train and held-out losses."""
    lrs: list[float] | None = None
    """Learning rates to run every optimizer at (a sweep, one interleaved round each); None: ``optim.lr``."""
    seed: int = 0
    threads: int = 1
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, weight_decay=0.1, warmup_steps=10))
    model: tiny.ModelConfig = field(default_factory=tiny.ModelConfig)


def corpus(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids): the stdlib's pydoc topics, every tenth topic held out."""
    from pydoc_data.topics import topics

    vocab = tokenizer.get_vocab()

    def encode(text: str) -> torch.Tensor:
        text = "".join(c if c in vocab else " " for c in text.lower())
        text = re.sub(r"\n\s*\n+", "\n\n", re.sub(r"[ \t]+", " ", text))
        return torch.tensor([vocab[c] for c in text], dtype=torch.long)

    names = sorted(topics)
    train = encode("\n".join(topics[n] for i, n in enumerate(names) if i % 10))
    heldout = encode("\n".join(topics[n] for i, n in enumerate(names) if i % 10 == 0))
    return train, heldout


def _windows(ids: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def _loss(model, windows: torch.Tensor) -> float:
    model.eval()
    loss = model(input_ids=windows, labels=windows).loss.item()
    model.train()
    return loss


class Run:
    """One optimizer's model, optimizer and curves; ``step`` times only the training work."""

    def __init__(self, name: str, cfg: BenchConfig, tokenizer):
        optim_cfg = copy.deepcopy(cfg.optim)
        optim_cfg.name = name
        if optim_cfg.ademamix.warmup_steps is None:
            optim_cfg.ademamix.warmup_steps = cfg.steps  # Algorithm 1: "we usually set it to T"
        self.grad_clip = optim_cfg.grad_clip
        self.model = tiny.build_model(cfg.model, tokenizer).train()  # same init_seed: same weights for all
        self.opt, self.sched = build_optimizer(self.model, optim_cfg, num_steps=cfg.steps)
        self.elapsed_s, self.opt_step_s = 0.0, 0.0
        self.curve = {"step": [], "time_s": [], "train": [], "heldout": []}

    def step(self, batch: torch.Tensor) -> None:
        start = time.perf_counter()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        before_step = time.perf_counter()
        self.opt.step()
        self.sched.step()
        end = time.perf_counter()
        self.elapsed_s += end - start
        self.opt_step_s += end - before_step

    def evaluate(self, step: int, evals) -> None:
        for key, value in (("step", step), ("time_s", self.elapsed_s), ("train", _loss(self.model, evals[0])),
                           ("heldout", _loss(self.model, evals[1]))):
            self.curve[key].append(value)


def train_all(cfg: BenchConfig, tokenizer, batches, evals) -> dict[str, dict]:
    """Train every optimizer on the same batches, interleaved step by step (rotating the order), so a
    burst of load from other processes on the shared cores slows all of them alike."""
    runs = {name: Run(name, cfg, tokenizer) for name in cfg.optimizers}
    for run in runs.values():
        run.evaluate(0, evals)
    order = list(runs.values())
    for step, batch in enumerate(batches, start=1):
        for run in order[step % len(order):] + order[: step % len(order)]:
            run.step(batch)
            if step % cfg.eval_every == 0 or step == len(batches):
                run.evaluate(step, evals)
    return {name: {**run.curve, "opt_step_ms": 1e3 * run.opt_step_s / len(batches)} for name, run in runs.items()}


def _at_time(curve: dict, seconds: float) -> int:
    """Index of the last evaluation made within ``seconds`` of training."""
    return max(i for i, t in enumerate(curve["time_s"]) if t <= seconds + 1e-9)


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors, styles = {}, {}
    for (name, lr), c in curves.items():
        color = colors.setdefault(name, f"C{len(colors)}")
        style = styles.setdefault(lr, ["-", "--", ":", "-."][len(styles) % 4])
        for ax, x in zip(axes, ("step", "time_s")):
            ax.plot(c[x], c["heldout"], marker=".", color=color, linestyle=style, label=f"{name} lr={lr:g}")
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("training seconds (evaluations excluded)")
    axes[0].set_ylabel("held-out loss (nats / character)")
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny Qwen2 on character-level pydoc text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(curves: dict[str, dict], lr: float, steps: int) -> list[dict]:
    """One row per optimizer; "equal time" is the shortest of these runs' training times."""
    equal_time_s = min(c["time_s"][-1] for c in curves.values())
    rows = []
    for name, c in curves.items():
        i = _at_time(c, equal_time_s)
        rows.append({"optimizer": name, "lr": lr, "steps": steps, "train_loss": c["train"][-1],
                     "heldout_loss": c["heldout"][-1], "train_s": c["time_s"][-1], "opt_step_ms": c["opt_step_ms"],
                     "equal_time_s": equal_time_s, "steps_at_equal_time": c["step"][i],
                     "heldout_at_equal_time": c["heldout"][i], "train_at_equal_time": c["train"][i]})
    return rows


def _summary(rows: list[dict]) -> list[str]:
    lines = []
    for lr in dict.fromkeys(r["lr"] for r in rows):
        group = [r for r in rows if r["lr"] == lr]
        for label, key in (("equal steps", "heldout_loss"), ("equal wall time", "heldout_at_equal_time")):
            ranked = sorted(group, key=lambda r: r[key])
            lines.append(f"lr={lr:g}, {label}: " + " < ".join(f"{r['optimizer']} {r[key]:.3f}" for r in ranked))
    if len({r["lr"] for r in rows}) > 1:
        best = {}
        for r in rows:
            if r["optimizer"] not in best or r["heldout_loss"] < best[r["optimizer"]]["heldout_loss"]:
                best[r["optimizer"]] = r
        lines.append("each at its best lr, equal steps: " + " < ".join(
            f"{r['optimizer']} {r['heldout_loss']:.3f} (lr={r['lr']:g})"
            for r in sorted(best.values(), key=lambda r: r["heldout_loss"])))
    return lines


def run(overrides: list[str], out_dir: Path) -> dict:
    cfg = apply_overrides(BenchConfig(), overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    curves, rows = {}, []
    try:
        tokenizer = tiny.build_tokenizer()
        train_ids, heldout_ids = corpus(tokenizer)
        gen = torch.Generator().manual_seed(cfg.seed)
        starts = torch.randint(0, len(train_ids) - cfg.seq_len, (cfg.steps, cfg.batch_size), generator=gen)
        batches = [_windows(train_ids, s, cfg.seq_len) for s in starts]
        evals = tuple(_windows(ids, torch.linspace(0, len(ids) - cfg.seq_len - 1, cfg.eval_windows).long(),
                               cfg.seq_len) for ids in (train_ids, heldout_ids))
        for lr in cfg.lrs or [cfg.optim.lr]:
            cfg_lr = copy.deepcopy(cfg)
            cfg_lr.optim.lr = lr
            lr_curves = train_all(cfg_lr, tokenizer, batches, evals)
            rows += _rows(lr_curves, lr, cfg.steps)
            curves.update({(name, lr): c for name, c in lr_curves.items()})
    finally:
        torch.set_num_threads(threads)
    png = out_dir.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    _plot(curves, png)
    return {
        "benchmark": "optimizers",
        "description": DESCRIPTION,
        "config": dataclasses.asdict(cfg),
        "corpus_chars": {"train": len(train_ids), "heldout": len(heldout_ids)},
        "table": rows,
        "summary": _summary(rows),
        "plot": str(png),
        "curves": {f"{name}@lr={lr:g}": c for (name, lr), c in curves.items()},
    }
