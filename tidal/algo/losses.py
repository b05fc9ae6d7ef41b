"""Per-token policy losses and how they are aggregated into one scalar.

Shapes: [B, T] for everything, with ``mask_bt`` 1 on response tokens. ``logp_bt`` comes from the
trainer (with grad); ``behav_logp_bt`` from the engine that sampled the tokens (no grad).
"""

from __future__ import annotations

import torch

from tidal.algo import LOSS_AGGREGATIONS, POLICY_LOSSES
from tidal.algo.config import AlgoConfig


def masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    return (x_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(loss_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """DAPO token-level loss (arXiv 2503.14476, sec. 3.3): sum over all tokens / number of tokens,
    so long responses are not down-weighted per token."""
    return masked_mean(loss_bt, mask_bt)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """GRPO's original aggregation: mean over each sequence's tokens, then mean over sequences."""
    per_seq = (loss_bt * mask_bt).sum(-1) / mask_bt.sum(-1).clamp(min=1)
    has_tokens = (mask_bt.sum(-1) > 0).float()
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    adv_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    cfg: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with a decoupled clip range and optional dual clip, per token.

    r = exp(logp - behav_logp);  loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    (Schulman et al. 2017; DAPO clip-higher eps_low=0.2, eps_high=0.28). With dual clip c and A < 0
    the loss is additionally capped at -c * A (Ye et al. 2020), so a token whose ratio exploded
    cannot dominate the update. Returns the per-token loss [B, T] and metrics.
    """
    log_ratio = (logp_bt - behav_logp_bt).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -adv_bt * ratio
    clipped = -adv_bt * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        loss = torch.where(adv_bt < 0, torch.minimum(loss, -adv_bt * cfg.dual_clip), loss)
    with torch.no_grad():
        was_clipped = (clipped > unclipped).float()
        metrics = {
            "algo/clip_frac": masked_mean(was_clipped, mask_bt).item(),
            "algo/ratio_mean": masked_mean(ratio, mask_bt).item(),
            "algo/ratio_max": ratio[mask_bt.bool()].max().item() if mask_bt.any() else 1.0,
            "algo/approx_kl": masked_mean(-log_ratio, mask_bt).item(),
        }
    return loss, metrics
