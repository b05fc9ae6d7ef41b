"""Per-token estimators of KL(pi || pi_ref) from samples of pi, as a loss term or a reward penalty.

From Schulman, "Approximating KL divergence" (2020, joschu.net/blog/kl-approx.html), with
x ~ pi and r = pi_ref(x) / pi(x):

- ``k1`` = -log r = logp - ref_logp: unbiased, high variance, negative on some samples;
- ``k2`` = (log r)^2 / 2: biased (low bias near pi = pi_ref), low variance, always >= 0;
- ``k3`` = (r - 1) - log r: unbiased, low variance, always >= 0 (GRPO's, DeepSeekMath eq. 4);
- ``k3_is`` = (pi / pi_old) * k3: DeepSeek-V3.2's "unbiased KL estimate" (arXiv 2512.02556), for
  samples drawn from pi_old rather than pi. Its gradient is the gradient of KL(pi || pi_ref): k3 alone,
  differentiated as a loss, gives E_pi[grad k3] = -E_pi[(pi_ref / pi) grad log pi], the gradient of
  KL(pi_ref || pi) instead, because it drops the score-function term k3 * grad log pi that the
  ratio's gradient restores. ``old_logp_bt=None`` uses pi itself (detached) as pi_old: weight 1 in
  value, and still the score-function term in the gradient.

Two ways to use one (the trainer wires them; ``AlgoConfig.kl_in_reward`` chooses):
- loss term: ``kl_loss`` = kl_coef * aggregate(k_bt) (GRPO, kl_coef = 0.04 in DeepSeekMath sec. 4.2);
- reward penalty: ``kl_reward_penalty`` = kl_coef * sum_t k_t per sequence, subtracted from that
  sequence's reward before advantages (InstructGPT-style, usually with k1); ``kl_reward_penalty_tokens``
  keeps it per token for estimators that fold it into token rewards (``reinforce_pp_token``).

An estimator is ``fn(logp_bt, ref_logp_bt) -> [B, T]``; one that corrects for the sampling policy also
takes ``old_logp_bt=`` (``kl_loss`` passes the behaviour log-probs it is given as ``behav_logp_bt``).
"""

from __future__ import annotations

import torch

from tidal.algo import KL_ESTIMATORS
from tidal.algo.aggregation import aggregate, masked_mean, zero_outside
from tidal.algo.config import bind

_MAX_LOG = 20.0  # k3 exponentiates the log-ratio: clamp it so r stays finite (e^20 ~ 5e8)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / pi_ref) per token."""
    return logp_bt - ref_logp_bt


@KL_ESTIMATORS.register("k2")
def kl_k2(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor) -> torch.Tensor:
    """k2 = (log(pi / pi_ref))^2 / 2 per token."""
    return 0.5 * (logp_bt - ref_logp_bt) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r with r = pi_ref / pi per token (log r clamped to +-20 before exp)."""
    log_r = (ref_logp_bt - logp_bt).clamp(-_MAX_LOG, _MAX_LOG)
    return log_r.exp() - 1 - log_r


@KL_ESTIMATORS.register("k3_is")
def kl_k3_is(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, old_logp_bt: torch.Tensor | None = None) -> torch.Tensor:
    """(pi / pi_old) * k3 per token: DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556) for tokens
    sampled from pi_old (the engine). The ratio is not detached: E_old[grad((pi / pi_old) k3)] is exactly
    grad KL(pi || pi_ref). ``old_logp_bt=None``: pi_old = sg(pi), so the value is k3 and the gradient
    gains k3 * grad log pi. The log-ratio is clamped to +-20 before exp."""
    old_logp_bt = logp_bt.detach() if old_logp_bt is None else old_logp_bt.detach()
    log_w = (logp_bt - old_logp_bt).clamp(-_MAX_LOG, _MAX_LOG)
    return log_w.exp() * kl_k3(logp_bt, ref_logp_bt)


def kl_loss(
    logp_bt: torch.Tensor,
    ref_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    kl_coef: float = 0.04,
    kl_estimator: str = "k3",
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
    behav_logp_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """kl_coef * aggregate(k(logp, ref_logp)) as a loss term; defaults are GRPO's (k3, 0.04).
    ``behav_logp_bt`` (the log-probs the tokens were sampled with) reaches estimators that take
    ``old_logp_bt`` (``k3_is``). Padding (mask 0) may hold -inf or NaN in any input: the inputs are
    selected (``zero_outside``) before the estimator runs, so neither the value nor a gradient sees it.
    Returns the scalar and ``algo/kl`` (the token mean of k, whatever the aggregation)."""
    logp_bt, ref_logp_bt, behav_logp_bt = (zero_outside(x, mask_bt) for x in (logp_bt, ref_logp_bt, behav_logp_bt))
    estimator = bind(KL_ESTIMATORS[kl_estimator], old_logp_bt=behav_logp_bt)
    k_bt = estimator(logp_bt, ref_logp_bt.detach())
    loss = kl_coef * aggregate(
        k_bt, mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=max_gen_len, weights_bt=agg_weights_bt
    )
    with torch.no_grad():
        kl = masked_mean(k_bt, mask_bt)
    return loss, {"algo/kl": kl}  # a device tensor: the trainer reads its metrics once per step


def kl_reward_penalty_tokens(
    logp_bt: torch.Tensor,
    ref_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    kl_coef: float = 0.02,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Per-token penalty kl_coef * k_t [B, T] (detached, 0 outside the mask): REINFORCE++ (arXiv 2501.03262)
    folds it into each token's reward, so a token's return carries only the KL of the tokens after it."""
    with torch.no_grad():
        k_bt = KL_ESTIMATORS[kl_estimator](zero_outside(logp_bt, mask_bt), zero_outside(ref_logp_bt, mask_bt))
        return kl_coef * zero_outside(k_bt * mask_bt, mask_bt)


def kl_reward_penalty(
    logp_bt: torch.Tensor,
    ref_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    kl_coef: float = 0.02,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Per-sequence penalty kl_coef * sum_t k_t [B] (detached), to subtract from each reward.
    Defaults: k1 and 0.02, the KL reward of InstructGPT's PPO (arXiv 2203.02155: objective in sec. 3.5,
    beta = 0.02 in appendix C)."""
    return kl_reward_penalty_tokens(logp_bt, ref_logp_bt, mask_bt, kl_coef=kl_coef, kl_estimator=kl_estimator).sum(-1)
