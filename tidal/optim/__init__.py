"""Optimizers and learning-rate schedules."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OptimConfig:
    """AdamW settings for RL (and the supervised warm start's own copy)."""

    lr: float = 2e-4
    """Peak learning rate. LLM recipes use ~1e-6 (DAPO); the 1M-parameter tiny model learns best near
    2e-4 (see the quickstart recipe)."""
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """Decoupled weight decay (Loshchilov & Hutter 2019); DAPO/Magistral use 0.1 on large models."""
    grad_clip: float = 1.0
    """Global grad-norm clip (DAPO/verl default 1.0)."""
    warmup_steps: int = 0
    """Linear warm-up steps, then constant."""


def build_optimizer(params, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    warm = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched
