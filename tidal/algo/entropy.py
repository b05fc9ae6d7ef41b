"""Token entropy in the objective: an entropy bonus, and training only the high-entropy tokens.

Both take the per-token entropies H_t of the policy's next-token distribution (at the sampling
temperature) that the trainer computes with the log-probs (``tidal.models.logprobs``):

- ``entropy_loss``: -entropy_coef * aggregate(H), added to the policy loss, so that minimizing the loss
  raises entropy (the entropy bonus of A3C, arXiv 1602.01783, and PPO, arXiv 1707.06347 eq. 9). Its
  gradient needs differentiable entropies, which the trainer computes only when the bonus is on.
- ``high_entropy_mask``: keep the top ``top_entropy_frac`` of response tokens by entropy ("Beyond the
  80/20 Rule", Wang et al., arXiv 2506.01939: the policy gradient of the ~20% highest-entropy
  "forking" tokens does the work; training on them alone matches or beats full updates). A mask
  transform, not a loss, so it composes with every policy loss: the trainer zeroes the dropped
  tokens' aggregation weights.
"""

from __future__ import annotations

import math

import torch

from tidal.algo.aggregation import aggregate, masked_mean, zero_outside

__all__ = ["entropy_loss", "high_entropy_mask"]


def entropy_loss(
    entropy_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    entropy_coef: float = 0.01,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """The entropy bonus as a loss term, -entropy_coef * aggregate(H): add it to the policy loss.

    The default 0.01 is A3C's beta (arXiv 1602.01783) and PPO's c2 on Atari (arXiv 1707.06347, eq. 9
    and its Atari hyperparameters); ``AlgoConfig.entropy_coef`` defaults to 0 (off), as in GRPO, DAPO and most LLM RL
    recipes. The gradient flows through ``entropy_bt`` if it carries one. ``algo/entropy_bonus`` is
    entropy_coef times the token mean of H, whatever the aggregation (a mean, so the trainer's
    token-weighted average over micro-batches is the minibatch's; as ``kl_loss``'s ``algo/kl``)."""
    if not entropy_coef >= 0:
        raise ValueError(f"entropy_coef must be >= 0 (an entropy bonus), got {entropy_coef!r}")
    entropy_bt = zero_outside(entropy_bt, mask_bt)  # padding may be NaN: select it away before any arithmetic
    bonus = entropy_coef * aggregate(
        entropy_bt, mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=max_gen_len, weights_bt=agg_weights_bt
    )
    with torch.no_grad():
        token_mean = masked_mean(entropy_bt, mask_bt)
    # float64 on the device, as the float it replaces: the trainer reads its metrics once per step
    return -bonus, {"algo/entropy_bonus": token_mean.double() * entropy_coef}


def high_entropy_mask(
    entropy_bt: torch.Tensor, mask_bt: torch.Tensor, *, top_entropy_frac: float = 0.2
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response tokens whose entropy is among the top ``top_entropy_frac`` of ``mask_bt``'s
    (default 0.2: the paper's 20%), as a float mask, with ``algo/entropy_threshold`` and
    ``algo/entropy_kept_frac`` (the fraction of response tokens kept).

    The threshold is the k-th largest entropy, k = ceil(top_entropy_frac * N) of the N response tokens
    (as the authors' code); tokens tied with it are all kept. The paper's threshold is over the batch;
    the trainer applies it per forward pass (the minibatch, or each micro-batch under
    ``trainer.micro_batch_tokens``, as the authors' verl code). ``top_entropy_frac`` = 1 keeps every
    token."""
    if not 0 < top_entropy_frac <= 1:
        raise ValueError(f"top_entropy_frac must be in (0, 1], got {top_entropy_frac!r}")
    keep_bt = mask_bt > 0
    values = entropy_bt.detach()[keep_bt]
    if values.numel() == 0:
        return torch.zeros_like(mask_bt), {"algo/entropy_threshold": 0.0, "algo/entropy_kept_frac": 0.0}
    # - 1e-9: frac * N computed in floats can land a hair above an integer (0.3 * 10 = 3.0000000000000004)
    k = max(1, math.ceil(top_entropy_frac * values.numel() - 1e-9))
    threshold = values.topk(k).values[-1]
    kept_bt = keep_bt & (entropy_bt.detach() >= threshold)
    return kept_bt.to(mask_bt.dtype), {"algo/entropy_threshold": threshold.item(),
                                       "algo/entropy_kept_frac": masked_mean(kept_bt.float(), mask_bt).item()}
