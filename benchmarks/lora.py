"""LoRA against full fine-tuning (issue 35): how fast each rank learns the quickstart, and what a step costs.

Anchor: "LoRA Without Regret" (Schulman et al., Thinking Machines 2025): in policy-gradient RL even rank-1
LoRA matches full fine-tuning, since an episode carries about one bit; LoRA's best learning rate is about
10x full fine-tuning's. TRL's replication on Qwen3-0.6B found rank 1 close but behind.

Two parts (``parts``):

- ``learning``: the quickstart (warm-started tiny bases, async RL), full fine-tuning and LoRA at each of
  ``ranks``. Each arm first sweeps its learning rates on ``sweep_seed`` (full: ``full_lrs``, LoRA:
  ``lora_lrs``, about 10x higher as the paper finds), keeps the one that reaches 0.85 in the fewest steps
  (ties: the higher final accuracy), then runs the other ``seeds`` at it. The same seed gives every arm the
  same base (the warm start is cached by seed). Goal: every rank reaches 0.85 with a median step count
  within 1.25x of full fine-tuning's.
- ``memory``: a Qwen2.5-0.5B-shaped model (``benchmarks/gpu.py`` ``MODELS``, random weights, built here),
  one trainer step on CPU, full vs rank ``memory_rank``: trainer peak memory (bytes held by parameters
  before the step plus the peak of tensor bytes allocated during it, ``utils/memory.tensor_peak_bytes``),
  optimizer state bytes after it, and the bytes of the weight update it sends to the engine. Goals:
  update bytes >= 50x smaller, peak memory <= 0.5x.

Top-level keys: ``median_steps_to_0.85_by_rank`` (rank -> median over seeds), ``full_median_steps_to_0.85``,
``sync_bytes_ratio`` and ``peak_mem_ratio`` (both LoRA / full: smaller is better), ``lr_sweep`` (every
sweep run), ``best_lr``.

    tidal bench lora [--set parts=[memory]] [--set seeds=[0]] [--set ranks=[1,4,16]] [--set lora_lrs=[2e-3]]

The full learning part is 4 arms x (3 sweep points + 2 seeds) quickstart runs of ``steps`` steps: hours on
2 CPU cores. A setting that is not one of this benchmark's ``Settings`` goes to the quickstart run config.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal import bench
from tidal.config import apply_overrides

DESCRIPTION = ("LoRA vs full fine-tuning: quickstart steps to 0.85 by rank (each at its best lr), "
               "0.5B-shaped step memory")
TARGET = 0.85


@dataclass
class Settings:
    """This benchmark's own knobs; any other ``--set`` key goes to the quickstart run config."""

    parts: list[str] = field(default_factory=lambda: ["memory", "learning"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    sweep_seed: int = 0
    """The seed each arm's learning-rate sweep runs on (its best run counts as that seed's)."""
    ranks: list[int] = field(default_factory=lambda: [1, 4, 16])
    full_lrs: list[float] = field(default_factory=lambda: [1e-4, 2e-4, 4e-4])
    """Full fine-tuning's sweep, around the quickstart's 2e-4 (its docstring's own sweep: 4e-4 was worse)."""
    lora_lrs: list[float] = field(default_factory=lambda: [1e-3, 2e-3, 4e-3])
    """LoRA's sweep: about 10x full fine-tuning's best, as LoRA Without Regret finds (alpha 32 for every rank)."""
    steps: int = 100
    """RL steps per run (no early stop: the late curve counts for ties)."""
    eval_every: int = 10
    memory_model: str = "qwen2.5-0.5b"
    memory_rank: int = 16
    memory_rows: int = 4
    """Sequences in the memory part's one training batch (one group)."""
    memory_prompt_len: int = 32
    memory_response_len: int = 96
    reuse: bool = True
    """Read runs (and the memory part) already measured with the same settings under ``--out`` instead of
    running them again: a long benchmark can be stopped and continued, or extended by seeds or lrs."""


def _settings(overrides: list[str]) -> tuple[Settings, list[str]]:
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    return apply_overrides(Settings(), mine), [o for o in overrides if o not in mine]


# ---- learning --------------------------------------------------------------------------------------
def _arm_overrides(rank: int | None, lr: float) -> list[str]:
    return [f"optim.lr={lr}", *([f"model.lora.rank={rank}"] if rank else [])]


def pick_best(runs: list[dict]) -> dict:
    """The sweep run that reached the target in the fewest steps; ties, or none reaching it: the best final."""
    return min(runs, key=lambda r: (r["steps_to_0.85"] is None, r["steps_to_0.85"] or 0, -r["final"]))


def median_steps(values: list[int | None]) -> float | None:
    """Median steps where a seed that never got there counts as infinitely slow (None if half never did)."""
    if not values:
        return None
    ranked = sorted(float("inf") if v is None else v for v in values)
    m = statistics.median(ranked)
    return None if m == float("inf") else m


def _same_run(row: dict, key: dict) -> bool:
    return all(row.get(k) == v for k, v in key.items())


def _quickstart_run(qs, s: Settings, rest: list[str], seed: int, rank: int | None, lr: float, out: Path) -> dict:
    """One quickstart run's summary; a run with the same arm, lr, seed, steps and overrides already in
    ``runs.jsonl`` (a previous, possibly stopped, invocation with the same ``--out``) is read, not run again."""
    from tidal.system.run import train

    key = {"arm": f"r{rank}" if rank else "full", "lr": lr, "seed": seed, "steps": s.steps, "eval_every": s.eval_every,
           "overrides": rest}
    log = out.parent / "runs.jsonl"
    if s.reuse and log.exists():
        done = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        found = next((r for r in reversed(done) if _same_run(r, key)), None)
        if found is not None:
            print(f"reused {json.dumps(key)}", flush=True)
            return found
    # plain GRPO, as these results were measured (the quickstart took pass@k and guidance in issue 39)
    _, cfg = qs.resolve(["recipe=quickstart_grpo", f"steps={s.steps}", f"eval_every={s.eval_every}", *rest,
                         *_arm_overrides(rank, lr)], seed)
    result = train(cfg, out)
    curve = [(h["step"], h.get("time/elapsed_s", 0.0), h["eval/accuracy"]) for h in result.history
             if "eval/accuracy" in h]
    summary = qs.summarize_seed(curve, [TARGET])
    row = {**key, "base": summary["base"], "steps_to_0.85": summary["steps_to_0.85"], "final": summary["final"],
           "best": summary["best"], "rl_s": curve[-1][1], "curve": [[step, acc] for step, _, acc in curve]}
    print(json.dumps(row), flush=True)
    with open(log, "a") as f:  # kept run by run: a stopped benchmark keeps what it measured
        f.write(json.dumps(row) + "\n")
    return row


def learning(s: Settings, rest: list[str], out_dir: Path) -> dict:
    qs = bench.load("quickstart")
    arms: list[int | None] = [None, *s.ranks]
    sweep, best_lr, by_arm = [], {}, {}
    for rank in arms:
        name = f"r{rank}" if rank else "full"
        lrs = s.full_lrs if rank is None else s.lora_lrs
        runs = [_quickstart_run(qs, s, rest, s.sweep_seed, rank, lr, out_dir / f"{name}_lr{lr:g}_s{s.sweep_seed}")
                for lr in lrs]
        sweep += runs
        best = pick_best(runs)
        best_lr[name] = best["lr"]
        lr = best["lr"]
        seeds = [best] + [_quickstart_run(qs, s, rest, seed, rank, lr, out_dir / f"{name}_lr{lr:g}_s{seed}")
                          for seed in s.seeds if seed != s.sweep_seed]
        by_arm[name] = seeds
    medians = {name: median_steps([r["steps_to_0.85"] for r in rows]) for name, rows in by_arm.items()}
    return {"median_steps_to_0.85_by_rank": {str(r): medians[f"r{r}"] for r in s.ranks},
            "full_median_steps_to_0.85": medians["full"], "best_lr": best_lr, "lr_sweep": sweep,
            "runs_at_best_lr": {name: rows for name, rows in by_arm.items()},
            "seeds_reaching_0.85": {name: sum(r["steps_to_0.85"] is not None for r in rows)
                                    for name, rows in by_arm.items()}}


# ---- memory ----------------------------------------------------------------------------------------
def _shaped_model(name: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    gpu = bench.load("gpu")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(Qwen2Config(**gpu.MODELS[name], attn_implementation="sdpa"),
                                                dtype=torch.float32)


def _batch(s: Settings, vocab: int):
    """One group of ``memory_rows`` random sequences, half rewarded: every row has a non-zero advantage. The
    behaviour log-probs are log(1 / vocab), what a random model's near-uniform softmax gives, so the ratio is
    about 1 and no token is clipped out of the gradient."""
    from tidal.algo.config import AlgoConfig
    from tidal.train.batch import build_train_batch
    from tidal.types import Group, Prompt, Trajectory

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (s.memory_prompt_len,), generator=g).tolist()
    uniform = -float(torch.log(torch.tensor(float(vocab))))
    trajs = []
    for i in range(s.memory_rows):
        tokens = torch.randint(3, vocab, (s.memory_response_len,), generator=g).tolist()
        trajs.append(Trajectory("p0", i, prompt, tokens, [uniform] * len(tokens), [0] * len(tokens), "length",
                                reward=float(i % 2)))
    return build_train_batch([Group(Prompt("p0", "", ""), trajs)], AlgoConfig(), 0)[0]


def _one_step(s: Settings, rank: int | None) -> dict:
    from tidal.algo.config import AlgoConfig
    from tidal.models import lora
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer
    from tidal.utils.memory import optimizer_state_bytes, tensor_peak_bytes

    model = _shaped_model(s.memory_model)
    if rank:
        model = lora.wrap(model, lora.LoraConfig(rank=rank))
    trainer = Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig(precision="fp32"), device="cpu")
    batch = _batch(s, model.config.vocab_size)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    metrics: dict = {}
    during = tensor_peak_bytes(lambda: metrics.update(trainer.step(batch)))
    trainer.state_dict_for_engine()
    row = {"arm": f"r{rank}" if rank else "full", "params": sum(p.numel() for p in model.parameters()),
           "trainable_params": trainer.num_trainable_params, "param_bytes": held, "step_peak_bytes": during,
           "peak_bytes": held + during, "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer),
           "weight_sync_bytes": int(trainer.weight_sync_metrics["perf/weight_sync_bytes"]),
           "grad_norm": metrics["train/grad_norm"]}
    print(json.dumps(row), flush=True)
    return row


def memory(s: Settings) -> dict:
    full = _one_step(s, None)
    gc.collect()  # the full model, its gradients and optimizer state go before the LoRA arm is built
    low = _one_step(s, s.memory_rank)
    return {"memory": {"model": s.memory_model, "rank": s.memory_rank, "rows": s.memory_rows,
                       "tokens_per_row": s.memory_prompt_len + s.memory_response_len, "full": full, "lora": low},
            "sync_bytes_ratio": low["weight_sync_bytes"] / full["weight_sync_bytes"],
            "peak_mem_ratio": low["peak_bytes"] / full["peak_bytes"],
            "optimizer_state_ratio": low["optimizer_state_bytes"] / full["optimizer_state_bytes"]}


def run(overrides: list[str], out_dir: Path) -> dict:
    s, rest = _settings(overrides)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    result: dict = {"benchmark": "lora", "description": DESCRIPTION, "settings": dataclasses.asdict(s),
                    "overrides": overrides, "median_steps_to_0.85_by_rank": None, "full_median_steps_to_0.85": None,
                    "sync_bytes_ratio": None, "peak_mem_ratio": None}
    table = []
    if "memory" in s.parts:
        mine = {k: v for k, v in dataclasses.asdict(s).items() if k.startswith("memory_")}
        saved = out_dir / "memory.json"
        previous = json.loads(saved.read_text()) if s.reuse and saved.exists() else None
        if previous is not None and previous.get("memory_settings") == mine:
            result.update({k: previous[k] for k in ("memory", "sync_bytes_ratio", "peak_mem_ratio",
                                                     "optimizer_state_ratio")})
        else:
            result.update(memory(s))
            out_dir.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({**result, "memory_settings": mine}, indent=2) + "\n")
        m = result["memory"]
        table += [{"part": "memory", "arm": m[k]["arm"], "lr": None, "seed": None, "steps_to_0.85": None,
                   "final": None, "peak_gb": m[k]["peak_bytes"] / 1e9, "optim_gb": m[k]["optimizer_state_bytes"] / 1e9,
                   "sync_mb": m[k]["weight_sync_bytes"] / 1e6} for k in ("full", "lora")]
    if "learning" in s.parts:
        result.update(learning(s, rest, out_dir))
        table += [{"part": "learning", "arm": r["arm"], "lr": r["lr"], "seed": r["seed"],
                   "steps_to_0.85": r["steps_to_0.85"], "final": r["final"], "peak_gb": None, "optim_gb": None,
                   "sync_mb": None} for r in result["lr_sweep"]]
        table += [{"part": "learning", "arm": r["arm"], "lr": r["lr"], "seed": r["seed"],
                   "steps_to_0.85": r["steps_to_0.85"], "final": r["final"], "peak_gb": None, "optim_gb": None,
                   "sync_mb": None} for rows in result["runs_at_best_lr"].values() for r in rows[1:]]
    result["table"] = table
    return result
