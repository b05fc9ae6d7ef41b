"""The algorithm's knobs, with each default's source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlgoConfig:
    """Advantage estimator, policy loss and aggregation, by registered name, plus their constants."""

    advantage: str = "grpo"
    """``grpo``: (r - mean_group) / (std_group + eps) (DeepSeekMath, arXiv 2402.03300 sec. 4.1.2)."""
    policy_loss: str = "ppo_clip"
    """``ppo_clip``: clipped surrogate (Schulman et al. 2017) with decoupled clip range."""
    loss_agg: str = "token_mean"
    """``token_mean``: every response token in the batch weighs the same (DAPO, arXiv 2503.14476 sec. 3.3)."""
    eps_low: float = 0.2
    """Lower clip: ratio >= 1 - eps_low (DAPO clip-higher keeps PPO's 0.2)."""
    eps_high: float = 0.28
    """Upper clip: ratio <= 1 + eps_high (DAPO clip-higher raises it to 0.28 against entropy collapse)."""
    dual_clip: float | None = 3.0
    """Dual-clip c for negative advantages (Ye et al. 2020, arXiv 1912.09729: c = 3); None disables."""
    adv_eps: float = 1e-6
    """Added to the group std in ``grpo`` so all-equal groups give zero advantage, not NaN."""
    skip_zero_adv_groups: bool = True
    """Drop groups whose rewards are all equal (zero advantage, no gradient): DAPO's dynamic-sampling
    filter without re-sampling; the dropped count is logged (``algo/zero_adv_groups``)."""
