"""Outcome-reward advantage estimators over groups of samples of one prompt.

Input ``rewards_gn`` is [G, N]: G prompts, N samples each. Output is one advantage per sample,
broadcast over its response tokens by the caller.
"""

from __future__ import annotations

import torch

from tidal.algo import ADVANTAGES
from tidal.algo.config import AlgoConfig


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards_gn: torch.Tensor, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps).

    The std is the unbiased sample std over the group (N - 1 in the denominator), as in the
    reference implementations (TRL, verl use ``torch.std``).
    """
    mean = rewards_gn.mean(dim=1, keepdim=True)
    std = rewards_gn.std(dim=1, keepdim=True) if rewards_gn.shape[1] > 1 else torch.zeros_like(mean)
    adv = (rewards_gn - mean) / (std + cfg.adv_eps)
    return adv, {"algo/adv_abs_mean": adv.abs().mean().item()}


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards_gn: torch.Tensor, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (arXiv 2503.20783, sec. 3.2): A_i = r_i - mean(r); no std division (removes the
    question-difficulty bias)."""
    adv = rewards_gn - rewards_gn.mean(dim=1, keepdim=True)
    return adv, {"algo/adv_abs_mean": adv.abs().mean().item()}
