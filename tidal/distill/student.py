"""Train a student offline from teacher data: supervised on traces, or forward KL to teacher distributions.

One loop (``train_student``) with three objectives, each a function of a batch of sequences:

- ``sft_loss``: next-token cross-entropy on the response tokens of verified teacher traces (the loss of
  tidal's supervised warm start, ``stages/warm_start.py``), computed through the RL trainer's packed path:
  sequences are packed end to end (``train/packing.py``: position ids restart per sequence,
  block-diagonal causal attention) and split into micro-batches of at most ``micro_batch_tokens``
  real tokens whose gradients are accumulated, so the step equals the whole batch's.
- ``sparse_kl_loss``: forward KL to the stored k-sparse teacher (``algo/distill.sparse_forward_kl``).
- ``full_kl_loss``: forward KL to the teacher's full distribution, computed on the fly by running the
  teacher on the same sequences (the reference the k-sparse losses are compared with).

The KL losses need the student's whole next-token distribution at each response position, so they run a
padded forward over the batch (the tiny models' vocabulary is 51 tokens; a large vocabulary would chunk
the head as ``models/logprobs.py`` does). Every loss is a mean over response tokens. Held-out greedy
accuracy is read every ``eval_every`` steps with the caller's evaluator (the RL runs' own).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.algo.distill import RESIDUAL_MODES, full_forward_kl, sparse_forward_kl
from tidal.config import ConfigError
from tidal.distill.shards import SparseSequence
from tidal.models.logprobs import token_logprobs
from tidal.optim import lr_factor
from tidal.optim.config import OptimConfig
from tidal.train.microbatch import pack_sequences
from tidal.train.packing import pack, packed_attention_mask, unpack
from tidal.utils.progress import progress_bar


@dataclass
class StudentConfig:
    """How the student trains on teacher data (``tidal distill traces|logits --set student.KEY=...``)."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step (the warm start's batch: small batches learned the most per example)."""
    lr: float = 3e-4
    """From the quickstart's partial base (0.37), SFT on teacher traces at the warm start's 1e-3 first fell
    to 0.26 and reached 0.56 after 200 steps; 3e-4 reached 0.63 after 25 steps and 0.85 after 175 (one
    seed, batch 64): a fresh Adam at 1e-3 knocks a partly trained model back before it helps."""
    schedule: str = "constant"
    """``constant`` lr, or ``cosine``: a half cosine from ``lr`` down to ``min_lr_ratio * lr`` over ``steps``
    (Loshchilov & Hutter, arXiv 1608.03983; ``optim.lr_factor``). At a constant 3e-4 the full KL to the
    teacher on held-out responses moved by 10-40% between evaluations 25 steps apart (the student
    overfits 2,000 sequences for ~20 epochs), so two students were compared by noise; the decay gives
    a stable end point to compare."""
    min_lr_ratio: float = 0.0
    """Where the ``cosine`` decay ends, as a fraction of ``lr``."""
    eval_every: int = 25
    """Steps between held-out greedy evaluations (step 0, the starting student, is always evaluated)."""
    micro_batch_tokens: int = 4096
    """Real tokens per forward/backward of the SFT loss (gradients accumulated over micro-batches)."""
    pack_tokens: int = 128
    """Longest packed row of the SFT loss, in tokens (CPU attention within a row is O(row^2))."""
    residual: str = "tail_bucket"
    """k-sparse KL: how the residual mass is handled (``tail_bucket``, ``uniform_tail`` or ``renormalize``;
    algo/distill.py)."""
    seed: int = 0
    """Order in which sequences are drawn."""
    max_time_s: float | None = None
    """Stop after this many seconds of training (checked between steps); None: ``steps`` only."""

    def __post_init__(self):
        validate(self)


def validate(cfg: StudentConfig) -> None:
    for key in ("steps", "batch_size", "eval_every", "micro_batch_tokens", "pack_tokens"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"student.{key} must be >= 1, got {getattr(cfg, key)}")
    if not cfg.lr > 0:
        raise ConfigError(f"student.lr must be > 0, got {cfg.lr}")
    if cfg.schedule not in ("constant", "cosine"):
        raise ConfigError(f"student.schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"student.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.residual not in RESIDUAL_MODES:
        raise ConfigError(f"student.residual must be one of {RESIDUAL_MODES}, got {cfg.residual!r}")


Sequence = tuple[list[int], list[int]]  # (prompt ids with BOS, response ids ending in EOS)


def _padded(seqs: list[Sequence], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and response mask ([B, T]; mask 1 on response tokens)."""
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros((len(seqs), width))
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor([*p, *r])
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) : len(p) + len(r)] = 1.0
    return ids, attn, resp


def sft_loss(model, seqs: list[Sequence], pad_id: int, cfg: StudentConfig) -> tuple[float, int]:
    """Backward of the mean next-token NLL over the response tokens, micro-batch by micro-batch on
    packed rows; returns (loss value, tokens)."""
    ids, attn, resp = _padded(seqs, pad_id)
    lengths = attn.sum(-1).tolist()
    total = float(resp.sum())
    loss_value = 0.0
    for micro in pack_sequences(lengths, cfg.micro_batch_tokens):
        rows = torch.tensor(sorted(micro))
        packed = pack(ids[rows], [lengths[i] for i in rows.tolist()], cfg.pack_tokens, pad_id)
        mask = packed_attention_mask(packed, model, "dense")  # with the model's sliding windows, if any
        logp_rl, _ = token_logprobs(model, packed.input_ids_rl, mask, position_ids=packed.position_ids_rl)
        logp_bt = unpack(logp_rl, packed, ids.shape[1])
        loss = -(logp_bt * resp[rows]).sum() / total
        loss.backward()
        loss_value += loss.item()
    return loss_value, int(total)


def response_logprobs(model, seqs: list[Sequence], pad_id: int) -> torch.Tensor:
    """Full next-token log-distributions ``[N, V]`` at every response position of ``seqs`` (in order): row
    j of a sequence predicts its response token j from the tokens before it."""
    ids, attn, resp = _padded(seqs, pad_id)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    predict_bt = torch.zeros_like(resp, dtype=torch.bool)  # position t-1 predicts token t
    predict_bt[:, :-1] = resp[:, 1:] > 0
    return logits[predict_bt].log_softmax(-1)


def sparse_kl_loss(model, seqs: list[SparseSequence], pad_id: int, cfg: StudentConfig) -> tuple[float, int]:
    logq = response_logprobs(model, [(s.prompt_ids, s.response_ids) for s in seqs], pad_id)
    ids = torch.cat([s.topk_ids for s in seqs])
    logp = torch.cat([s.topk_logp for s in seqs])
    residual = torch.cat([s.residual for s in seqs])
    loss = sparse_forward_kl(logq, ids, logp, residual, residual=cfg.residual).mean()
    loss.backward()
    return loss.item(), len(residual)


def full_kl_loss_with(teacher) -> Callable:
    """The full-vocabulary forward KL loss against ``teacher`` (run on the same sequences, no gradient)."""

    def full_kl_loss(model, seqs: list[Sequence], pad_id: int, cfg: StudentConfig) -> tuple[float, int]:
        with torch.no_grad():
            logp = response_logprobs(teacher, seqs, pad_id)
        logq = response_logprobs(model, seqs, pad_id)
        loss = full_forward_kl(logq, logp).mean()
        loss.backward()
        return loss.item(), len(logp)

    return full_kl_loss


def student_lr(step: int, cfg: StudentConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based): ``cfg.lr``, or its cosine decay over ``cfg.steps``."""
    sched = OptimConfig(lr=cfg.lr, schedule=cfg.schedule, decay_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
    return cfg.lr * lr_factor(step, sched)


Evaluate = Callable[[torch.nn.Module], "float | dict[str, float]"]
"""Held-out greedy accuracy of a model, or a dict with ``accuracy`` and other measures (kept in the curve)."""


@dataclass
class StudentResult:
    curve: list[dict]  # {"step", "seconds", "accuracy", "loss"} at each evaluation
    seconds: float
    steps: int


def train_student(model, data: list, loss_fn: Callable, cfg: StudentConfig, pad_id: int,
                  evaluate: Evaluate | None = None, progress: bool = True, desc: str = "student") -> StudentResult:
    """Train ``model`` in place for ``cfg.steps`` steps on ``data`` (shuffled epochs) with ``loss_fn``."""
    validate(cfg)
    if not data:
        raise ConfigError("no training sequences: the teacher data is empty (did the verifier reject every trace?)")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    curve: list[dict] = []
    seconds, loss = 0.0, float("nan")

    def check(step: int) -> None:
        if evaluate is None:
            return
        model.eval()
        measured = evaluate(model)
        model.train()
        measured = dict(measured) if isinstance(measured, dict) else {"accuracy": float(measured)}
        curve.append({"step": step, "seconds": round(seconds, 3), **measured, "loss": loss})
        bar.set_postfix(acc=f"{measured['accuracy']:.3f}", loss=f"{loss:.3f}")

    bar = progress_bar(progress, total=cfg.steps, desc=desc, leave=False)
    model.train()
    check(0)
    step = 0
    while step < cfg.steps and (cfg.max_time_s is None or seconds < cfg.max_time_s):
        start = time.perf_counter()
        while len(order) < cfg.batch_size:
            epoch = list(range(len(data)))
            rng.shuffle(epoch)
            order += epoch
        batch, order = [data[i] for i in order[: cfg.batch_size]], order[cfg.batch_size :]
        opt.zero_grad(set_to_none=True)
        for group in opt.param_groups:
            group["lr"] = student_lr(step, cfg)
        loss, _ = loss_fn(model, batch, pad_id, cfg)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seconds += time.perf_counter() - start
        step += 1
        bar.update(1)
        if step % cfg.eval_every == 0:
            check(step)
    if evaluate is not None and (not curve or curve[-1]["step"] != step):
        check(step)
    bar.close()
    model.eval()
    return StudentResult(curve, seconds, step)
