"""What every supervised stage shares: the model it starts from, its data order, its run directory.

A stage starts from ``model.path`` (a Hugging Face directory: a base, or the previous stage's ``model/``)
or, without one, builds the tiny model with the chat tokenizer (``models/tiny.py``). It writes what
``tidal train`` writes (``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_<k>/`` through
``train/checkpoint.py``, ``--resume``/``--overwrite`` with ``tidal train``'s rules) and, at the end,
``model/``: a ``save_pretrained`` directory the next stage and RL take as ``model.path``.

The data order is a function of (seed, step): step k takes the k-th ``batch_size`` slice of the
concatenation of per-epoch permutations, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tidal.config import ConfigError, save_yaml
from tidal.models import catalog, lora, tiny
from tidal.optim import OptimConfig, build_optimizer
from tidal.stages.chat_data import GENERATION_CHAT_TEMPLATE, PLAIN_TEMPLATE, load_examples
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.checkpoint import TrainingState, latest_checkpoint, load_checkpoint, save_checkpoint
from tidal.utils import outputs


@dataclass
class DataConfig:
    """Where a stage's rows come from."""

    path: str = ""
    """Training rows: ``.jsonl``, ``.parquet`` or a ``save_to_disk`` directory."""
    eval_path: str = ""
    """Held-out rows in the same format; empty: the last ``eval_fraction`` of ``path`` (after a seeded shuffle)."""
    eval_fraction: float = 0.05
    """Held-out share when ``eval_path`` is empty (at least one row)."""
    split: str = "train"
    """The split of a saved ``DatasetDict`` (``eval_path`` then reads its own ``split``: ``test`` if present)."""
    max_length: int = 128
    """Tokens per row; longer rows are cut (the tiny model's context is 128)."""
    chat_template: str = ""
    """A Jinja file replacing the tokenizer's chat template. Its ``{% generation %}`` blocks, if it has any, mark
    the assistant tokens; without them the mask is derived from how it renders each turn (``chat_data.derived_mask``),
    which needs a template that renders a turn the same whatever follows (``GENERATION_CHAT_TEMPLATE`` is ChatML's
    with tags)."""


STAGE_BETAS = (0.9, 0.999)
"""AdamW's betas in the stages: transformers' ``TrainingArguments`` defaults (``adam_beta1/2``), which TRL's
SFT/DPO/Reward configs inherit; RL's ``optim.betas`` default is (0.9, 0.99)."""


def stage_optim(lr: float) -> OptimConfig:
    """A stage's ``optim.*``: ``tidal.optim``'s ``OptimConfig`` (the one RL takes: ``optim.name`` adamw, ademamix
    or muon, ``optim.schedule`` constant, cosine or linear, docs/optimizers.md) with TRL's defaults where RL's
    differ: ``lr`` (each stage's TRL default), ``betas`` ``STAGE_BETAS`` and ``adamw_kernel`` ``fused``
    (transformers' default optimizer since torch 2.8, ``adamw_torch_fused``, so TRL's too; RL keeps the CPU loop).
    Warm-up 0, a constant lr, no weight decay, eps 1e-8 and grad clip 1.0 are both packages' defaults."""
    return OptimConfig(lr=lr, betas=STAGE_BETAS, adamw_kernel="fused")


@dataclass
class RunConfig:
    """The loop around a stage's loss."""

    steps: int = 100
    batch_size: int = 16
    """Rows per optimizer step (a preference row is one pair)."""
    eval_every: int = 50
    """Steps between held-out evaluations (and after the last step)."""
    save_every: int = 50
    """Steps between checkpoints (and after the last step)."""
    keep: int = 2
    async_checkpoint: bool = True
    """Write checkpoints in the background (``train/async_checkpoint.py``, as ``tidal train``'s
    ``async_checkpoint``): the step pays for a host copy; the stage waits for the last write before it ends."""
    seed: int = 0
    threads: int = 0
    """torch threads on CPU; 0 leaves torch's default."""


def load_policy(model_cfg: tiny.ModelConfig, data: DataConfig):
    """(model, tokenizer): ``model.path`` or the tiny model (``model.tokenizer`` char: ``PLAIN_TEMPLATE``,
    RL's plain prompts; chat: ChatML with generation marks), with the chat template ``data.chat_template``
    names, or ChatML with generation marks where the tokenizer has none."""
    if model_cfg.path:
        model, tokenizer = tiny.load(model_cfg.path)
    else:
        tokenizer = tiny.tokenizer_for(model_cfg)
        model = tiny.build_model(model_cfg, tokenizer)
        tokenizer.chat_template = GENERATION_CHAT_TEMPLATE if model_cfg.tokenizer == "chat" else PLAIN_TEMPLATE
    if data.chat_template:
        tokenizer.chat_template = Path(data.chat_template).read_text()
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GENERATION_CHAT_TEMPLATE
    return model, tokenizer


def check_lora(model_cfg: tiny.ModelConfig) -> None:
    """``model.lora`` before any work (RL's own rules, ``lora.validate``): adapters need a trained base to adapt
    (``model.path``; the model built from ``model.*`` is random), and a stage runs on the CPU, where QLoRA's
    4-bit base cannot."""
    lora.validate(model_cfg.lora)
    if not model_cfg.lora.enabled:
        return
    if not model_cfg.path:
        raise ConfigError(f"model.lora.rank={model_cfg.lora.rank} needs model.path: LoRA adapts a trained base, and "
                          "without model.path the stage builds a random one (set model.path, or model.lora.rank=0)")
    if model_cfg.lora.quantize != "none":
        raise ConfigError(f"model.lora.quantize={model_cfg.lora.quantize} (QLoRA) needs CUDA, and the stages run on "
                          "the CPU: use model.lora.quantize=none")


def with_lora(model: torch.nn.Module, model_cfg: tiny.ModelConfig, seed: int, name: str,
              log: Callable[[str], None] = print, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """``model`` itself (``model.lora.rank`` 0), or LoRA adapters on it, frozen, through RL's own code
    (``lora.wrap``): the optimizer gets the adapters only (``run_stage``), checkpoints hold them in PEFT's layout,
    and ``model/`` is the base with them merged (``export``). A's random start is drawn from ``seed``, so a stage
    run is as reproducible with adapters as without."""
    if not model_cfg.lora.enabled:
        return model
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = lora.wrap(model, model_cfg.lora, catalog.resolve(model_cfg.path), task_type)
    trained = sum(p.numel() for p in lora.trainable_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    log(f"{name}: LoRA rank {model_cfg.lora.rank} on {model_cfg.path}: {trained:,} of {total:,} parameters trained")
    return model


def train_and_held(cfg, encode: Callable, tokenizer, log: Callable[[str], None] = print) -> tuple[list, list]:
    """A stage's (training rows, held-out rows), encoded by ``encode``: ``data.eval_path``'s rows held out, else the
    last ``data.eval_fraction`` of ``data.path``'s after a seeded shuffle (``split_rows``); each file's line (rows
    read, rows skipped and why) logged. The one place sft, dpo and rm read their data."""
    d = cfg.data
    rows, line = load_examples(d.path, encode, tokenizer, d.max_length, d.split)
    log(line)
    if not d.eval_path:
        return split_rows(rows, d.eval_fraction, cfg.run.seed)
    held, line = load_examples(d.eval_path, encode, tokenizer, d.max_length, d.split)
    log(line)
    return rows, held


def split_rows(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle, the last ``fraction`` (at least one row) held out."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    num_eval = max(1, int(round(fraction * len(examples))))
    if num_eval >= len(examples):
        raise ConfigError(f"{len(examples)} rows cannot be split into train and held out: give data.eval_path")
    return [examples[i] for i in order[:-num_eval]], [examples[i] for i in order[-num_eval:]]


def batch_indices(num_rows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Rows of step ``step``: the step-th slice of the concatenated per-epoch permutations."""
    out, start = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        out += perm[offset: offset + batch_size - len(out)]
    return out


def rows_digest(rows: list) -> str:
    """xxh3-128 of ``rows`` in order: each a dataclass of token-id lists (``SFTExample``, ``PairExample``), or a
    tuple of such and tensors (DPO's rows with their reference log-probs). What a resume compares, so that
    another data file of the same size (or the same file under another template or ``max_length``) is told
    apart from the run's own rows; the count alone cannot."""
    h = xxhash.xxh3_128()

    def add(x) -> None:
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                add(getattr(x, f.name))
        elif isinstance(x, torch.Tensor):
            h.update(repr((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, (list, tuple)):
            h.update(len(x).to_bytes(8, "little"))
            try:
                h.update(array("q", x).tobytes())
            except TypeError:  # not a list of ints: its items one by one
                for y in x:
                    add(y)
        else:
            h.update(repr(x).encode())

    add(list(rows))
    return h.hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 of a model's state (names, dtypes, shapes, bytes): the identity of a reference model whose
    log-probs a run saved, whichever path it was loaded from (~6 GB/s: 0.3 s for a 0.5B model in float32)."""
    h = xxhash.xxh3_128()
    for name, t in sorted(model.state_dict().items()):
        h.update(repr((name, t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


StepFn = Callable[[torch.nn.Module, list], tuple[torch.Tensor, dict[str, float]]]
EvalFn = Callable[[torch.nn.Module], dict[str, float]]


STAGE_OUTPUTS = ("config.yaml", "metrics.jsonl", "checkpoints", "model", "model.tmp", "reference_logps.pt")
"""Everything a stage writes into its directory (``--overwrite`` deletes what it wrote under these names)."""

StageDirError = outputs.OutputError
"""``--out`` cannot take this run (one line on the command line)."""


def open_run(out: str | Path, resume: bool, overwrite: bool, log: Callable[[str], None] = print,
             kind: str = "stage", cfg=None) -> outputs.RunDir:
    """Check ``out`` can take the run and lock it, with ``tidal train``'s rules (``utils/outputs.py``):
    ``--resume`` continues the run there (a run of this ``kind``), ``--overwrite`` replaces it, and a previous
    run is never silently mixed with a new one; no input in ``cfg`` may be a file the run would delete or
    rewrite. The stage then reads its model and rows and calls ``begin``, which deletes (with ``--overwrite``)
    only once they loaded: a bad input leaves the previous run as it was."""
    return outputs.RunDir.open(out, outputs.Layout(kind, STAGE_OUTPUTS, ("metrics.jsonl", "model")),
                               resume=resume, overwrite=overwrite,
                               inputs=outputs.config_inputs(cfg) if cfg is not None else None,
                               checkpoint=lambda d: latest_checkpoint(d / "checkpoints"), log=log, begin=False)


def run_stage(name: str, cfg, model: torch.nn.Module, tokenizer, train_rows: list, step_fn: StepFn,
              eval_fn: EvalFn, out: str | Path, resume: bool = False, overwrite: bool = False,
              log: Callable[[str], None] = print, clock_start: float | None = None) -> dict:
    """After ``open_run``: train ``model`` with ``step_fn`` (loss, metrics of a batch of rows) for
    ``cfg.run.steps`` steps, evaluating with ``eval_fn`` and checkpointing as ``cfg.run`` says; write
    ``out/model``; return the last metrics. ``cfg`` has ``optim`` and ``run`` (``tidal.optim.OptimConfig``,
    ``RunConfig``). ``perf/wall_s`` counts from ``clock_start`` (a stage's work before the loop, e.g. DPO's
    reference pass), ``perf/train_s`` is that less the evaluations."""
    out = Path(out)
    run, optim = cfg.run, cfg.optim
    if run.threads:
        torch.set_num_threads(run.threads)
    # RL's optimizer and schedule (tidal.optim): over the model (Muon tells its hidden matrices by name), or with
    # LoRA over the adapters only (with_lora; validate_stage refuses Muon there, as RL does); a decay's
    # optim.decay_steps=max_steps ends on the run's last step, run.steps
    target = lora.trainable_parameters(model) if lora.is_peft(model) else model
    opt, sched = build_optimizer(target, optim, num_steps=run.steps)
    start = 0
    metrics_path = out / "metrics.jsonl"
    data = rows_digest(train_rows)  # saved with each checkpoint: a resume continues on the same rows
    if resume:
        ckpt = latest_checkpoint(out / "checkpoints")
        if ckpt is None:
            raise ConfigError(f"--resume: {out} has no checkpoint")
        state = load_checkpoint(ckpt, model, opt, sched)
        if state.extra.get("data", data) != data:  # a checkpoint from before the digest was saved: unchecked
            raise StageDirError(f"--resume: the training rows ({len(train_rows)}, data.path={cfg.data.path}) are not "
                                f"the rows {ckpt} was trained on, so its step {state.step} would not continue the "
                                "run; resume with the run's own data, or start again with --overwrite")
        start = state.step
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        metrics_path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= start))
        log(f"{name}: resumed from {ckpt} (step {start})")
    save_yaml(cfg, out / "config.yaml")  # after a resume's checks: never replaced by a config the run refused
    model.train()
    # background checkpoint writes; on an error the (non-daemon) writer still finishes before the process exits
    writer = AsyncCheckpointer() if run.async_checkpoint else None
    last: dict = {}
    t0, tokens, eval_s = time.perf_counter(), 0, 0.0
    clock_start = t0 if clock_start is None else clock_start
    for step in range(start, run.steps):
        rows = [train_rows[i] for i in batch_indices(len(train_rows), run.batch_size, run.seed, step)]
        loss, metrics = step_fn(model, rows)
        lr = sched.get_last_lr()[0]  # this step's (optim.warmup_steps, optim.schedule), as RL logs it
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        tokens += int(metrics.pop("num_tokens", 0))
        done = step + 1
        row = {"step": done, "train/loss": float(loss.detach()), "train/grad_norm": float(grad_norm), "train/lr": lr,
               **{f"train/{k}": v for k, v in metrics.items()},
               "perf/tokens_per_s": tokens / max(time.perf_counter() - t0 - eval_s, 1e-9)}
        if done % run.eval_every == 0 or done == run.steps:
            t_eval = time.perf_counter()
            model.eval()
            with torch.no_grad():
                row.update({f"eval/{k}": v for k, v in eval_fn(model).items()})
            model.train()
            eval_s += time.perf_counter() - t_eval
            log(f"{name} step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                   if k.startswith(("train/loss", "eval/"))))
        row["perf/wall_s"] = time.perf_counter() - clock_start
        row["perf/train_s"] = row["perf/wall_s"] - eval_s
        if not all(math.isfinite(v) for v in row.values() if isinstance(v, float)):
            raise FloatingPointError(f"{name} step {done}: a non-finite metric {row}")
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        last = row
        if done % run.save_every == 0 or done == run.steps:
            state = TrainingState(step=done, version=done, next_group=0, extra={"data": data})
            if writer is not None:  # each checkpoint, once on disk, goes into the run's record of its files
                writer.save(out / "checkpoints", model, tokenizer, opt, sched, state, keep=run.keep,
                            on_saved=lambda _path: outputs.sweep(out))
            else:
                save_checkpoint(out / "checkpoints", model, tokenizer, opt, sched, state, keep=run.keep)
                outputs.sweep(out)
    if writer is not None:
        writer.wait()
    export(model, tokenizer, out / "model")
    return last


def export(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """The stage's result as a Hugging Face directory (weights, config, tokenizer with its chat template). A LoRA
    stage's adapters are merged into its base first (W0 + s B A), so ``model/`` is a plain model every next stage,
    RL and ``tidal eval`` take as ``model.path``; the adapters alone stay in ``checkpoints/``."""
    if lora.is_peft(model):
        model = model.merge_and_unload()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    outputs.install(tmp, path, path.parent)  # a user's own file inside model/ stays
