"""Clip-Cov and KL-Cov: keep policy entropy from collapsing by restraining high-covariance tokens.

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al., arXiv
2505.22617) shows that under policy-gradient updates the change in policy entropy is driven by the
covariance between a token's log-probability and its advantage: a likely token with a positive
advantage (or an unlikely one with a negative advantage) sharpens the distribution. Estimated per
token over the batch,

    Cov_t = (log pi(y_t) - mean_j log pi(y_j)) * (A_t - mean_j A_j)      (means over response tokens)

it is mostly positive, so entropy falls monotonically. A tiny fraction of tokens with the largest
covariance carries most of it, and restraining only those keeps entropy up:

- ``clip_cov`` (Clip-Cov): the PPO surrogate, but a random ``clip_cov_frac`` of the tokens whose
  covariance lies in (``clip_cov_low``, ``clip_cov_high``) gets no loss and no gradient;
- ``kl_cov`` (KL-Cov): the unclipped ratio objective -r A, plus ``kl_cov_coef`` * |log r| on the
  ``kl_cov_frac`` tokens with the largest covariance.

The statistics (means, counts, the top fraction) are over the response tokens passed in one call:
in the trainer, one forward pass (the minibatch, unless ``trainer.micro_batch_tokens`` splits it),
as in the authors' verl implementation, which also uses max(1, floor(frac * N)) tokens.
"""

from __future__ import annotations

import torch

from tidal.algo import POLICY_LOSSES
from tidal.algo.aggregation import masked_mean
from tidal.algo.losses import (
    _MAX_LOG,
    _broadcast_adv,
    _check,
    _finish,
    _frac,
    _ppo_surrogate,
    _ratio_metrics,
    _zero_padding,
)

__all__ = ["token_covariance", "clip_cov", "kl_cov"]


def token_covariance(logp_bt: torch.Tensor, adv_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Cov_t = (logp_t - mean logp)(A_t - mean A), means over the response tokens; detached, 0 elsewhere."""
    logp_bt, adv_bt = logp_bt.detach(), adv_bt.detach()
    keep_bt = mask_bt > 0
    centered_logp_bt = logp_bt - masked_mean(torch.where(keep_bt, logp_bt, 0.0), mask_bt)
    centered_adv_bt = adv_bt - masked_mean(torch.where(keep_bt, adv_bt, 0.0), mask_bt)
    return torch.where(keep_bt, centered_logp_bt * centered_adv_bt, 0.0)


def _num_selected(frac: float, mask_bt: torch.Tensor) -> int:
    """max(1, floor(frac * N)) of the N response tokens (0 when there are none): the authors' count, so a
    small batch still restrains its most extreme token."""
    num_tokens = int((mask_bt > 0).sum())
    return max(1, int(frac * num_tokens)) if num_tokens else 0


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 1.0,
    clip_cov_frac: float = 2e-4,
    clip_cov_low: float = 1.0,
    clip_cov_high: float = 5.0,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Clip-Cov (arXiv 2505.22617, sec. 4): PPO's per-token surrogate, except that max(1, floor(r N))
    tokens drawn uniformly at random from those with clip_cov_low < Cov_t < clip_cov_high (and not
    already clipped by PPO) get loss 0 and no gradient:

        loss_t = 0 if t in I_clip else -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    Defaults are the paper's and its released 7B/32B scripts': r = 2e-4, covariance band (1, 5), PPO
    clip range 1.0 / 1.0 (so the ratio clip is nearly off and the covariance clip does the work),
    ``token_mean`` aggregation. The draw uses torch's global RNG (seed it for reproducibility).
    ``algo/cov_clip_frac`` is the fraction of response tokens detached."""
    _check("clip_cov_frac", clip_cov_frac, 0 < clip_cov_frac <= 1, "in (0, 1]")
    _check("clip_cov_high", clip_cov_high, clip_cov_high > clip_cov_low, f"> clip_cov_low={clip_cov_low}")
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = logp_bt - old_logp_bt.detach()
    loss_bt, ppo_clipped_bt = _ppo_surrogate(log_ratio_bt, adv_bt, eps_low, eps_high)
    with torch.no_grad():
        cov_bt = token_covariance(logp_bt, adv_bt, mask_bt)
        in_band_bt = (mask_bt > 0) & ~ppo_clipped_bt & (cov_bt > clip_cov_low) & (cov_bt < clip_cov_high)
        detach_bt = _random_subset(in_band_bt, _num_selected(clip_cov_frac, mask_bt))
    loss_bt = torch.where(detach_bt, 0.0, loss_bt)
    loss = _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        metrics = {
            "algo/clip_frac": _frac(ppo_clipped_bt, mask_bt),
            "algo/clip_frac_low": _frac(ppo_clipped_bt & (adv_bt < 0), mask_bt),
            "algo/clip_frac_high": _frac(ppo_clipped_bt & (adv_bt > 0), mask_bt),
            "algo/cov_clip_frac": _frac(detach_bt, mask_bt),
        }
        weight_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp() * (1 if is_weight_bt is None else is_weight_bt)
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, weight_bt))
    return loss, metrics


def _random_subset(candidates_bt: torch.Tensor, num: int) -> torch.Tensor:
    """A mask of ``num`` positions drawn uniformly without replacement from ``candidates_bt`` (all of
    them when there are fewer)."""
    chosen_bt = torch.zeros_like(candidates_bt)
    flat = candidates_bt.flatten().nonzero().squeeze(-1)
    pick = flat[torch.randperm(len(flat))[:num].to(flat.device)]
    chosen_bt.view(-1)[pick] = True
    return chosen_bt


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    kl_cov_frac: float = 2e-3,
    kl_cov_coef: float = 1.0,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """KL-Cov (arXiv 2505.22617, sec. 4): the unclipped ratio objective, with a KL penalty between the
    old and current policy on the max(1, floor(k N)) tokens of largest covariance:

        loss_t = -r_t A_t + beta |log r_t| [t in top-k(Cov)]

    |log r| is the per-token KL estimate the authors' implementation penalizes. Defaults: k = 2e-3
    (the paper's Qwen2.5-7B setting; 2e-4 for 32B), beta = 1, ``token_mean`` aggregation. There is no
    ratio clip: the penalty is the trust region, on the tokens that drive entropy down.
    ``algo/kl_cov_frac`` is the fraction of response tokens penalized."""
    _check("kl_cov_frac", kl_cov_frac, 0 < kl_cov_frac <= 1, "in (0, 1]")
    _check("kl_cov_coef", kl_cov_coef, kl_cov_coef >= 0, ">= 0")
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = logp_bt - old_logp_bt.detach()
    ratio_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    with torch.no_grad():
        cov_bt = token_covariance(logp_bt, adv_bt, mask_bt)
        penalized_bt = _top_k(cov_bt, mask_bt, _num_selected(kl_cov_frac, mask_bt))
    loss_bt = -adv_bt * ratio_bt + torch.where(penalized_bt, kl_cov_coef * log_ratio_bt.abs(), 0.0)
    loss = _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        metrics = {"algo/clip_frac": 0.0, "algo/kl_cov_frac": _frac(penalized_bt, mask_bt)}
        weight_bt = ratio_bt * (1 if is_weight_bt is None else is_weight_bt)
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, weight_bt))
    return loss, metrics


def _top_k(values_bt: torch.Tensor, mask_bt: torch.Tensor, num: int) -> torch.Tensor:
    """A mask of the ``num`` response positions with the largest values."""
    chosen_bt = torch.zeros_like(mask_bt, dtype=torch.bool)
    flat = (mask_bt > 0).flatten().nonzero().squeeze(-1)
    top = values_bt.flatten()[flat].topk(min(num, len(flat))).indices
    chosen_bt.view(-1)[flat[top]] = True
    return chosen_bt
