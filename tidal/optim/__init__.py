"""Optimizers and the learning-rate schedule: ``build_optimizer(model, cfg) -> (optimizer, scheduler)``.

``optim.name`` picks one of the ``OPTIMIZERS`` (docs/optimizers.md compares them on a small LM run):

- ``adamw``: ``torch.optim.AdamW`` with the recipe's betas and eps (the default; unchanged behaviour), fused on
  CUDA (``adamw_kernel``).
- ``ademamix``: AdEMAMix (arXiv 2409.03137), Adam whose numerator adds ``alpha`` times a slow gradient EMA
  so that old gradients keep contributing for thousands of steps. ``pytorch_optimizer``'s implementation,
  built with ``weight_decouple=True``: its default is L2 decay folded into the gradient, while the paper's
  Algorithm 1 decays the weights directly, as AdamW does.
- ``muon``: Muon on the hidden 2-D weights plus AdamW on embeddings, head, norms and biases, wrapped as
  one optimizer (``muon.py``, ``combined.py``). It needs the model, not just its parameters, to tell the
  two sets apart.

Every builder returns a plain ``torch.optim.Optimizer``; the schedule (linear warm-up, then constant or a
cosine/linear decay: ``lr_factor``) is one ``LambdaLR`` that rescales every parameter group from its own base
lr, so Muon's matrices and AdamW's vectors move together. A decay's length defaults to the rest of the run
(``optim.decay_steps=max_steps``), resolved when the run builds its optimizer (``for_run``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable

import torch

from tidal.config import ConfigError
from tidal.optim.combined import CombinedOptimizer
from tidal.optim.config import RUN_LENGTH, AdEMAMixConfig, MuonConfig, OptimConfig
from tidal.optim.muon import Muon, newton_schulz, split_hidden_matrices
from tidal.registry import Registry

ModelOrParams = torch.nn.Module | Iterable[torch.Tensor]
OPTIMIZERS: Registry[Callable[[ModelOrParams, OptimConfig], torch.optim.Optimizer]] = Registry("optimizer")

__all__ = ["OPTIMIZERS", "RUN_LENGTH", "AdEMAMixConfig", "CombinedOptimizer", "Muon", "MuonConfig", "OptimConfig",
           "adamw_kernel", "build_optimizer", "for_run", "newton_schulz", "split_hidden_matrices"]


def _params(target: ModelOrParams) -> Iterable[torch.Tensor]:
    return target.parameters() if isinstance(target, torch.nn.Module) else target


def adamw_kernel(params: list[torch.Tensor], kernel: str = "auto") -> dict[str, bool]:
    """Which of ``torch.optim.AdamW``'s implementations to run over ``params`` (``kernel``: ``optim.adamw_kernel``),
    decided here for every AdamW ``build_optimizer`` makes: ``fused=True`` (one kernel per step for every
    parameter, PyTorch's recommended fastest path: the docs' "Algorithms" note on ``fused``) when every
    parameter is a plain floating-point CUDA tensor, or any plain floating-point tensor with ``fused``; ``loop``
    the per-parameter loop; otherwise PyTorch's own default, as before (on CPU the per-parameter loop, so CPU
    results are unchanged). FSDP's sharded DTensors keep the default: the fused kernel's support for them varies
    across PyTorch versions."""
    def plain(p: torch.Tensor) -> bool:
        return p.is_floating_point() and type(p.data) is torch.Tensor and (p.is_cuda or kernel == "fused")
    if kernel == "loop":
        return {"foreach": False}
    return {"fused": True} if params and all(plain(p) for p in params) else {}


@OPTIMIZERS.register("adamw")
def adamw(target: ModelOrParams, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = list(_params(target))
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **adamw_kernel(params, cfg.adamw_kernel))


@OPTIMIZERS.register("ademamix")
def ademamix(target: ModelOrParams, cfg: OptimConfig) -> torch.optim.Optimizer:
    from pytorch_optimizer import AdEMAMix  # imported here: the package takes ~2 s to import

    c = cfg.ademamix
    # Keywords only: AdEMAMix swallows unknown ones into its defaults, so a renamed one would be ignored
    # silently; tests/optim/test_ademamix.py checks the schedule against Algorithm 1 step by step.
    return AdEMAMix(_params(target), lr=cfg.lr, betas=(*cfg.betas, c.beta3), alpha=c.alpha,
                    t_alpha_beta3=c.warmup_steps, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    weight_decouple=True, fixed_decay=False)


@OPTIMIZERS.register("muon")
def muon(target: ModelOrParams, cfg: OptimConfig) -> torch.optim.Optimizer:
    if not isinstance(target, torch.nn.Module):
        raise TypeError("optim.name=muon needs the model, not a parameter list: Muon trains only the hidden 2-D "
                        "weights and tells them from embeddings, the head, norms and biases by module and name "
                        "(call build_optimizer(model, cfg))")
    hidden, rest = split_hidden_matrices(target)
    m = cfg.muon
    parts = []
    if hidden:
        parts.append(Muon(hidden, lr=cfg.lr if m.lr is None else m.lr, weight_decay=cfg.weight_decay,
                          momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr))
    if rest:
        parts.append(adamw(rest, cfg))
    return CombinedOptimizer(*parts)


def for_run(cfg: OptimConfig, num_steps: int | None) -> OptimConfig:
    """``cfg`` for a run of ``num_steps`` optimizer steps: ``decay_steps=max_steps`` (``RUN_LENGTH``) becomes
    the steps left after warm-up (at least 1), so the decay ends on the run's last step. A copy: the config
    itself keeps ``max_steps``, so a saved config rescales with the next run's length. An integer
    ``decay_steps``, or ``num_steps`` None, leaves ``cfg`` as it is."""
    if cfg.decay_steps != RUN_LENGTH or num_steps is None:
        return cfg
    return dataclasses.replace(cfg, decay_steps=max(num_steps - max(cfg.warmup_steps, 0), 1))


def build_optimizer(target: ModelOrParams, cfg: OptimConfig, num_steps: int | None = None) -> tuple[
        torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer named by ``cfg.name`` over ``target`` (a model, or an iterable of parameters for the
    optimizers that need no names), and its LR schedule (``lr_factor``) for a run of ``num_steps`` optimizer
    steps (``for_run``; the RL trainer's is ``max_steps`` x ``trainer.num_minibatches``)."""
    cfg = for_run(cfg, num_steps)
    if cfg.schedule != "constant" and cfg.decay_steps == RUN_LENGTH:
        raise ConfigError(f"optim.decay_steps={RUN_LENGTH} (decay until the run's last step) with optim.schedule="
                          f"{cfg.schedule} needs the run's length: build_optimizer(..., num_steps=...), or set "
                          "optim.decay_steps to a number of optimizer steps")
    opt = OPTIMIZERS.get(cfg.name)(target, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg=cfg))
    return opt, sched


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """The multiplier of every group's base lr at optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then ``cfg.schedule`` (constant, or a cosine / linear decay to ``min_lr_ratio`` over
    ``decay_steps``, a number: ``for_run`` resolves ``max_steps``)."""
    warm = max(cfg.warmup_steps, 0)
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    assert isinstance(cfg.decay_steps, int), f"optim.decay_steps={cfg.decay_steps!r}: resolve it with for_run"
    progress = min(1.0, (step - warm) / max(cfg.decay_steps, 1))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
