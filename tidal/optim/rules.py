"""The optimizer keys' rules, one list for every command that takes ``optim.*`` (``utils/rules.py``).

RL (``system/validate.py``), its critic, and the stages (``tidal sft|dpo|rm``, ``stages.pretrain``) check
their optimizer keys here, so a value RL refuses is refused everywhere with the same words: a stage's
``optim.grad_clip=-1`` used to reach ``clip_grad_norm_``, which then flips every gradient and trains uphill,
and ``optim.betas=[0.9]`` an ``IndexError`` inside AdamW. A config that lacks a key (a stage's AdamW has no
``eps`` or ``muon``) skips its rule.
"""

from __future__ import annotations

from typing import Any

from tidal.config import ConfigError
from tidal.optim.config import RUN_LENGTH
from tidal.utils.rules import COUNT, NONNEG, Rule, check, fraction, optional, positive, renamed, unit

OPTIM_RULES: list[Rule] = [
    ("optim.lr", positive, "> 0"),
    ("optim.eps", positive, "> 0"),
    ("optim.weight_decay", NONNEG, ">= 0"),
    ("optim.grad_clip", positive, "> 0"),
    ("optim.adamw_kernel", lambda v: v in ("auto", "fused", "loop"), "auto, fused or loop"),
    ("optim.warmup_steps", NONNEG, "an integer >= 0"),
    ("optim.decay_steps", lambda v: v == RUN_LENGTH or COUNT(v),
     f"an integer >= 1, or {RUN_LENGTH} (decay until the run's last step)"),
    ("optim.min_lr_ratio", unit, "in [0, 1]"),
    ("optim.ademamix.alpha", NONNEG, ">= 0"),
    ("optim.ademamix.beta3", fraction, "in [0, 1)"),
    ("optim.ademamix.warmup_steps", optional(COUNT), "an integer >= 1 (or null)"),
    ("optim.muon.momentum", fraction, "in [0, 1)"),
    ("optim.muon.ns_steps", COUNT, "an integer >= 1"),
    ("optim.muon.lr", optional(positive), "> 0 (or null: optim.lr)"),
]


def check_betas(betas: Any, key: str = "optim.betas") -> None:
    """AdamW's (beta1, beta2): two numbers in [0, 1)."""
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(fraction(b) for b in betas):
        shown = list(betas) if isinstance(betas, (list, tuple)) else betas
        raise ConfigError(f"{key} must be two numbers in [0, 1) (beta1, beta2), got {shown!r}")


def check_optim(optim: Any, key: str = "optim") -> None:
    """Every ``OPTIM_RULES`` key the section ``optim`` has, and its betas, named under ``key`` (``optim``,
    ``critic.optim``; ``""`` for a config whose optimizer keys sit at the top, as ``stages.pretrain``'s
    ``lr``)."""
    prefix = f"{key}." if key else ""
    check(optim, renamed(OPTIM_RULES, "optim.", ""), missing_ok=True, where=prefix)
    if hasattr(optim, "betas"):
        check_betas(optim.betas, f"{prefix}betas")
