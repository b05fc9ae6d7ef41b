"""Supervised warm start: a short next-token stage on the task's reference answers, to a *partial* base.

RL needs a base model that sometimes succeeds. This stage trains the tiny model from scratch on
"<bos>prompt answer<eos>" with the loss on the answer tokens only, until its held-out greedy
accuracy enters a stated band (``sft.accuracy_band``), checked every ``check_every`` steps.

Why a band and not a step count: accuracy on 2-digit addition jumps from ~0.05 to ~0.7 within about
200 steps, and where a fixed step count lands on that jump depends on float rounding: the same
300-step config gave a 0.39 base on an AMD CPU and 0.26 on an Intel one (issue 15), and two warm
starts differing only in their held-out rows gave 0.47 and 0.07. The RL recipe is tuned for a base
in the band, so the band is the contract. When one check interval jumps over the whole band, the
stage rewinds to the last check (model, optimizer and data-stream state) and replays that interval
checking every step. If a single step still jumps over the band, that step is taken again from the
state before it at half the learning rate (at most ``MAX_LR_HALVINGS`` times; the lower rate is kept
until the band is reached): a step of SFT's lr 1e-3 can move the tiny model's accuracy by 0.1, more
than the quickstart's band is wide (0.382 to 0.480 seen at batch 128). It fails with a clear message if
accuracy never enters the band, or still jumps over it at the lowest rate.

The result is saved with ``save_pretrained`` into a cache directory keyed by a hash of everything
that affects it, so a second run loads it instead of training again. Writes go to a private
temporary directory renamed into place, so concurrent runs on a cold cache never collide and a
crash never leaves a half-written entry; an entry that is unreadable (a truncated file) is rebuilt.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.api import Task
from tidal.config import ConfigError
from tidal.models import prompts, tiny, vlm
from tidal.models.tiny import ModelConfig
from tidal.tasks.supervised import sft_batch, vision_sft_batch
from tidal.utils.progress import progress_bar
from tidal.utils.seeding import stable_hash


@dataclass
class SFTConfig:
    """The warm-start stage (skipped when ``model.path`` points at an existing model)."""

    steps: int = 1500
    """Most optimizer steps. With ``accuracy_band`` the stage stops as soon as held-out accuracy is in
    the band (on 2-digit addition, batch 64, lr 1e-3: after ~250-450 steps depending on seed and CPU);
    with ``accuracy_band: null`` it trains exactly this many steps."""
    accuracy_band: list[float] | None = field(default_factory=lambda: [0.3, 0.45])
    """Stop at the first check whose held-out greedy accuracy is in ``[low, high]``: the partial base
    RL starts from. The quickstart narrows it to [0.40, 0.46]: its bases at 0.31 needed 2-3x the RL
    steps (issue 15) and those below 0.38 were its slow seeds over ten (issue 39; ``tidal bench
    quickstart``, ``recipes/quickstart.py``); null trains ``steps`` steps with no checks."""
    check_every: int = 10
    """Steps between accuracy checks (one greedy pass over the held-out prompts, ~0.2 s for the tiny
    model). A jump over the whole band within one interval is replayed checking every step."""
    batch_size: int = 64
    """Small batches learned more per example than 128 or 256 in our sweeps (same accuracy per
    example seen, 2-4x more steps per second)."""
    lr: float = 1e-3
    """Beat 3e-3 and 1e-2 on early loss in a sweep on this task."""
    seed: int = 0
    """Seed of the warm start's data order (the model's init is ``model.init_seed``)."""
    cache_dir: str = ".tidal_cache"
    """Where warm-started bases are kept, one sub-directory per config hash."""

    def __post_init__(self):
        validate(self)


class WarmStartError(ConfigError):
    """The warm start cannot produce the base it was asked for (printed as one line by the CLI)."""


def validate(cfg: SFTConfig) -> None:
    """Raise naming the key when the warm-start config cannot run (``--set`` bypasses ``__init__``)."""
    if cfg.steps < 1:
        raise WarmStartError(f"sft.steps must be >= 1, got {cfg.steps}")
    if cfg.batch_size < 1:
        raise WarmStartError(f"sft.batch_size must be >= 1, got {cfg.batch_size}")
    if not cfg.lr > 0:
        raise WarmStartError(f"sft.lr must be > 0, got {cfg.lr}")
    if cfg.check_every < 1:
        raise WarmStartError(f"sft.check_every must be >= 1, got {cfg.check_every}")
    band = cfg.accuracy_band
    if band is not None and not (len(band) == 2 and 0.0 <= band[0] <= band[1] <= 1.0):
        raise WarmStartError(f"sft.accuracy_band must be [low, high] with 0 <= low <= high <= 1, got {band}")


FINGERPRINT_PROMPTS = 4096
FINGERPRINT_DEMOS = 64


def data_fingerprint(task: Task) -> int:
    """A hash of the training prompts the warm start can draw (up to the first 4,096): a data file
    rewritten in place under the same path must not reuse a base trained on its old contents. Where a
    demonstration is more than the answer (a tool trace, a conversation behind an environment's system
    prompt), the first 64 are hashed too: the same prompts with a demonstration changed in code (a tool
    renamed, a prompt reworded) train another base. Demonstrations that are the answer add nothing, so
    those tasks keep the keys their cached bases were saved under."""
    n = min(task.num_train, FINGERPRINT_PROMPTS)
    prompts = [task.train_prompt(i) for i in range(n)]
    demos = [d for p in prompts[:FINGERPRINT_DEMOS] if (d := task.sft_example(p)) != p.answer]
    return stable_hash(task.num_train, *((p.text, p.answer) for p in prompts), *([repr(demos)] if demos else []))


def cache_path(model_cfg: ModelConfig, task_cfg, sft_cfg: SFTConfig, task: Task) -> Path:
    model = dataclasses.asdict(model_cfg)
    model.pop("lora", None)  # how RL trains the base (LoRA or every weight) is not part of the base
    # bases cached before these keys existed keep their cache keys
    for key, default in (("prompt_format", "auto"), ("system_prompt", None), ("vision", False)):
        if model.get(key) == default:
            model.pop(key)
    if model.get("tokenizer") == "char" and not model_cfg.vision:  # the default: older bases keep their key
        del model["tokenizer"]
    else:  # a vocabulary changed in code (e.g. new chat tokens) must not reuse a base trained on the old one
        model["tokenizer_vocab"] = stable_hash(*sorted(tiny.tokenizer_for(model_cfg).get_vocab().items()))
    key = json.dumps([model, dataclasses.asdict(task_cfg),
                      {k: v for k, v in dataclasses.asdict(sft_cfg).items() if k != "cache_dir"},
                      data_fingerprint(task)], sort_keys=True)
    return Path(sft_cfg.cache_dir) / f"base-{stable_hash(key):016x}"


Evaluate = Callable[[torch.nn.Module, object], float]
"""``evaluate(model, tokenizer) -> held-out greedy accuracy``: supplied by the run wiring
(``system/run.py``), so the band is read with the same engine, prompts and reward as RL's step 0."""

MAX_LR_HALVINGS = 3
"""How often a step that jumps over the band is retaken at half the rate before the stage gives up."""

SCREEN_PROMPTS = 25
"""Held-out prompts a band check tries first (``screened_accuracy``)."""


def screened_accuracy(successes: Callable[[list], int], prompts: list, low: float) -> float:
    """Held-out accuracy for a band check, screened: ``successes(prompts)`` counts the greedy successes
    on some prompts. While the base cannot do the task at all (the first checks of every warm start),
    a full evaluation is wasted; for an agent environment it is 200 episodes through its servers, most
    of a warm start's time. So the first 25 prompts go first, and none right reads as 0.0. A base whose
    accuracy is already at the band's low end (>= 0.3) gets 0 of 25 right with probability
    0.7**25 < 1.4e-4, and then the next check (accuracy higher still) sees it. Otherwise every prompt
    is evaluated, the screened ones again, so a check that passes the screen reads exactly what an
    unscreened one would. No screen where it would not save much (fewer than 100 prompts) or for a
    band starting at 0."""
    if low <= 0 or len(prompts) < 4 * SCREEN_PROMPTS:
        return successes(prompts) / max(len(prompts), 1)
    if successes(prompts[:SCREEN_PROMPTS]) == 0:
        return 0.0
    return successes(prompts) / len(prompts)


def warm_start(model_cfg: ModelConfig, task: Task, task_cfg, sft_cfg: SFTConfig,
               evaluate: Evaluate | None = None, progress: bool = True) -> Path:
    """Return a directory with the warm-started base model, training it only if not cached.

    ``evaluate`` is required when ``sft_cfg.accuracy_band`` is set."""
    validate(sft_cfg)
    out = cache_path(model_cfg, task_cfg, sft_cfg, task)
    if _cached(out):
        return out
    if sft_cfg.accuracy_band is not None and evaluate is None:
        raise WarmStartError("sft.accuracy_band is set but no evaluator was given (warm_start(evaluate=...))")
    tokenizer = prompts.attach(tiny.tokenizer_for(model_cfg), model_cfg.prompts())  # prompted as RL will be
    model = tiny.build_model(model_cfg, tokenizer).train()
    result = _train(model, tokenizer, task, sft_cfg, evaluate, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # private: parallel runs never share it
    try:
        tiny.save(model, tokenizer, tmp)
        (tmp / "tidal_sft.json").write_text(json.dumps(result))
        _publish(tmp, out)
    except OSError as e:
        if not _cached(out):  # losing a race to a concurrent run that wrote the same base is fine
            raise WarmStartError(f"warm start: could not write the base to {out}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` atomically. If ``out`` exists, a concurrent run finished first (keep
    theirs), or it is an unreadable entry, which is moved aside and replaced."""
    try:
        os.replace(tmp, out)
    except OSError:
        if _cached(out):
            return
        broken = Path(tempfile.mkdtemp(prefix=f".{out.name}.broken.", dir=out.parent))
        os.replace(out, broken / "entry")
        shutil.rmtree(broken, ignore_errors=True)
        os.replace(tmp, out)


def _cached(out: Path) -> bool:
    """True when ``out`` holds a complete, readable base. The marker file is written last; the
    safetensors header is parsed so a truncated weights file is rebuilt rather than crashing the run."""
    if not (out / "tidal_sft.json").exists() or not (out / "config.json").exists():
        return False
    from safetensors import safe_open

    weights = list(out.glob("*.safetensors"))
    try:
        for f in weights:
            safe_open(str(f), "pt")  # checks the header against the file's size: a truncated file fails
    except Exception:
        return False
    return bool(weights)


def _train(model, tokenizer, task: Task, cfg: SFTConfig, evaluate: Evaluate | None, progress: bool) -> dict:
    """Train in place until the band (or ``cfg.steps`` without one); the summary saved with the base."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    band = cfg.accuracy_band
    check_every = cfg.check_every
    step, loss, history, halvings = 0, float("nan"), [], 0
    last_check = _snapshot(model, opt, gen, step)
    bar = progress_bar(progress, total=cfg.steps, desc="warm start (SFT)", leave=False)
    while step < cfg.steps:
        idx = torch.randint(0, task.num_train, (cfg.batch_size,), generator=gen).tolist()
        loss_t = _loss(model, tokenizer, task, [task.train_prompt(i) for i in idx])
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, loss = step + 1, loss_t.item()
        bar.update(1)
        if band is None or step % check_every:
            continue
        model.eval()
        acc = float(evaluate(model, tokenizer))
        model.train()
        history.append([step, acc])
        bar.set_postfix(acc=f"{acc:.3f}")
        if band[0] <= acc <= band[1]:
            bar.close()
            return {"steps": step, "final_loss": loss, "accuracy": acc, "accuracy_band": band, "checks": history,
                    "lr_halvings": halvings}
        if acc > band[1]:
            if check_every == 1 and halvings < MAX_LR_HALVINGS:  # retake this one step at half the rate
                halvings += 1
                step = _restore(last_check, model, opt, gen)
                for group in opt.param_groups:
                    group["lr"] = cfg.lr / 2**halvings
                bar.n = step
                continue
            if check_every == 1:
                bar.close()
                # the step before this one (a replay's first step follows the check it rewound to)
                prev = next((a for s, a in reversed(history[:-1]) if s < step), float("nan"))
                raise WarmStartError(
                    f"warm start: held-out accuracy jumped over sft.accuracy_band={band} in one step "
                    f"(from {prev:.3f} to {acc:.3f} at step {step}, also at sft.lr/{2**halvings:g}); widen the band "
                    "or lower sft.lr")
            step = _restore(last_check, model, opt, gen)  # replay the interval, checking every step
            bar.n = step
            check_every = 1
            continue
        last_check = _snapshot(model, opt, gen, step)
    bar.close()
    if band is not None:
        best = max((a for _, a in history), default=float("nan"))
        raise WarmStartError(
            f"warm start: held-out accuracy never entered sft.accuracy_band={band} in sft.steps={cfg.steps} "
            f"steps (last {history[-1][1] if history else float('nan'):.3f}, best {best:.3f}); raise sft.steps "
            "or sft.lr, lower the band, or set sft.accuracy_band=null to train exactly sft.steps")
    return {"steps": step, "final_loss": loss, "accuracy": None, "accuracy_band": None, "checks": []}


def _loss(model, tokenizer, task: Task, chosen: list) -> torch.Tensor:
    """Mean next-token loss over the answer tokens of ``chosen``'s examples; a vision-language model (its
    processor on ``tokenizer``) reads each prompt's images (``vlm.vlm_token_logprobs``, the images once each)."""
    if vlm.processor_of(tokenizer) is None:
        ids_bt, attn, labels = sft_batch(tokenizer, task, chosen)
        return model(input_ids=ids_bt, attention_mask=attn, labels=labels).loss
    batch, answer_bt = vision_sft_batch(tokenizer, task, chosen)
    logp_bt = vlm.vlm_token_logprobs(model, batch)
    return -(logp_bt * answer_bt).sum() / answer_bt.sum()


def _snapshot(model, opt, gen, step: int) -> tuple:
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gen.get_state(), step)


def _restore(snap: tuple, model, opt, gen) -> int:
    model_state, opt_state, gen_state, step = snap
    model.load_state_dict(model_state)
    opt.load_state_dict(copy.deepcopy(opt_state))
    gen.set_state(gen_state)
    return step
