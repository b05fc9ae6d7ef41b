"""The supervised loop the distillation benchmarks build their local teachers with (``distill_vocab``,
``distill_sparse``): AdamW (betas 0.9 / 0.95, no weight decay), optional linear warm-up then a half cosine
to 0, gradient norm clipped at 1, and the model's state kept at one step to serve as the student's start."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def cosine(step: int, steps: int, peak: float, warmup: int = 0) -> float:
    """Linear warm-up over ``warmup`` steps, then a half cosine from ``peak`` to 0 at ``steps``."""
    return peak * min(1.0, (step + 1) / warmup if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * step / steps))


def train_lm(model: torch.nn.Module, steps: int, lr: float, step_loss: Callable[[int], torch.Tensor],
             keep_at: int, warmup: int = 0) -> tuple[dict, list[dict]]:
    """Train ``model`` for ``steps`` steps on ``step_loss(step)`` (the loss of that step's batch). Returns
    (a copy of the state after ``keep_at`` steps, the loss at every tenth of the run)."""
    if not 1 <= keep_at <= steps:
        raise ValueError(f"student_step={keep_at} must be in 1..{steps} (the teacher's training steps)")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    kept, curve = None, []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine(step, steps, lr, warmup)
        loss = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step + 1 == keep_at:
            kept = {k: v.clone() for k, v in model.state_dict().items()}
        if (step + 1) % max(steps // 10, 1) == 0:
            curve.append({"step": step + 1, "train_nll": loss.item()})
    return kept, curve
