"""Off-policy corrections for the engine/trainer mismatch, effective sample size, VCPO's lr scale.

The engine samples token y_t with log-prob ``behav_logp`` (pi_behav); the trainer, with the very
same weights, scores it ``old_logp`` (pi_old). Kernels, precision and batch composition make the
two differ, so "on-policy" training is secretly off-policy (Yao et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", 2025, fengyao.notion.site/off-policy-rl). A correction
turns the ratio rho_t = pi_old / pi_behav into a per-token weight [B, T] that multiplies any policy
loss's per-token term (``is_weight_bt=``):

- ``tis`` (truncated IS, Yao et al.): token level w_t = min(rho_t, C); sequence level
  w = min(prod_t rho_t, C) for every token of the sequence. C = 2 in their experiments.
- ``mis`` (masked IS; Liu, Yao et al., "When Speed Kills Stability: Demystifying RL Collapse from
  the Training-Inference Mismatch", 2025; token-level: IcePop): w = rho if lo <= rho <= hi else 0,
  per token or per sequence. Instead of shrinking outliers it drops them, which keeps the kept
  ones unbiased.

Every weight is detached (a constant in the loss) and computed in log space, so extreme log-ratios
(a sequence product of many tokens) neither overflow nor give NaN. With old == behav both are
exactly 1: a no-op.

Effective sample size ESS = (sum w)^2 / (n sum w^2), normalized to (0, 1]: 1 when all weights are
equal, 1/n when one dominates. VCPO (Huang et al., arXiv 2602.17616) finds collapse of asynchronous
RL is preceded by ESS drops and scales the step with it (``ess_lr_scale``).
"""

from __future__ import annotations

import math

import torch

from tidal.algo import CORRECTIONS

_MAX_LOG = 20.0  # |log ratio| beyond this is clamped before exp (e^20 ~ 5e8): finite, still extreme


def sequence_log_ratio(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """log prod_t (p_t / q_t) over response tokens: sum_t mask * (logp - ref_logp), one per sequence."""
    return ((logp_bt - ref_logp_bt) * mask_bt).sum(-1)


def effective_sample_size(w: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Normalized ESS (sum w)^2 / (n sum w^2) over the entries where ``mask`` is 1, in (0, 1].

    1.0 when there are no entries (nothing to discount); 0.0 when every weight is 0."""
    w = w.detach().double()
    w = w[mask.bool()] if mask is not None else w.flatten()
    if w.numel() == 0:
        return 1.0
    sq = (w * w).sum()
    return 0.0 if sq == 0 else float(w.sum() ** 2 / (w.numel() * sq))


def effective_sample_size_log(log_w: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """ESS from log weights (e.g. sequence log-ratios, whose exp overflows): exp(2 lse(lw) - lse(2 lw)) / n."""
    log_w = log_w.detach().double()
    log_w = log_w[mask.bool()] if mask is not None else log_w.flatten()
    if log_w.numel() == 0:
        return 1.0
    return math.exp(2 * torch.logsumexp(log_w, 0).item() - torch.logsumexp(2 * log_w, 0).item()) / log_w.numel()


def ess_lr_scale(ess: float, *, ess_base_ratio: float = 1.0, ess_lr_rule: str = "sqrt") -> float:
    """VCPO's learning-rate multiplier from the normalized ESS of a minibatch's importance weights.

    scale = sqrt(min(1, ess / base)) (``sqrt``, VCPO's rule for AdamW-style optimizers, eta_eff
    proportional to sqrt(ESS / B)) or min(1, ess / base) (``linear``); base = 1.0 by default
    (Huang et al., arXiv 2602.17616; github.com/mit-han-lab/vcpo ``ess_scaling``). VCPO computes
    the ESS from per-sequence importance ratios pi_theta / pi_behav over the minibatch."""
    assert ess_base_ratio > 0, f"ess_base_ratio must be positive, got {ess_base_ratio}"
    ratio = min(1.0, max(0.0, float(ess)) / ess_base_ratio)
    rules = {"sqrt": math.sqrt, "linear": lambda x: x}
    assert ess_lr_rule in rules, f"ess_lr_rule must be one of {sorted(rules)}, got {ess_lr_rule!r}"
    return rules[ess_lr_rule](ratio)


def _log_rho(old_logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor, mask_bt: torch.Tensor, level: str):
    """Log weight per token [B, T] at ``level``: the token's own log ratio, or its sequence's sum."""
    assert level in ("token", "sequence"), f"level must be 'token' or 'sequence', got {level!r}"
    log_rho_bt = (old_logp_bt - behav_logp_bt).detach() * mask_bt
    if level == "sequence":
        log_rho_bt = log_rho_bt.sum(-1, keepdim=True).expand_as(mask_bt)
    return log_rho_bt


def _metrics(prefix: str, w_bt: torch.Tensor, hit_bt: torch.Tensor, mask_bt: torch.Tensor, level: str):
    rows = (mask_bt.sum(-1) > 0).float()
    if level == "sequence":
        frac = (hit_bt[:, 0].float() * rows).sum() / rows.sum().clamp(min=1)
        ess = effective_sample_size(w_bt[:, 0], rows)
    else:
        frac = (hit_bt.float() * mask_bt).sum() / mask_bt.sum().clamp(min=1)
        ess = effective_sample_size(w_bt, mask_bt)
    return {f"algo/{prefix}_frac": frac.item(), "algo/is_ess": ess}


@CORRECTIONS.register("none")
def no_correction(
    old_logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weight 1 everywhere: trust that trainer and engine agree."""
    return torch.ones_like(mask_bt, dtype=old_logp_bt.dtype), {}


@CORRECTIONS.register("tis")
def truncated_is(
    old_logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    tis_level: str = "token",
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025): w = min(rho, C), rho = pi_old / pi_behav per
    token or, at ``sequence`` level, the product over the sequence's tokens. C = 2 (their default).
    Returns weights [B, T] (detached) and ``algo/tis_frac`` (share truncated) and ``algo/is_ess``."""
    assert tis_cap > 0, f"tis_cap must be positive, got {tis_cap}"
    log_rho_bt = _log_rho(old_logp_bt, behav_logp_bt, mask_bt, tis_level)
    log_cap = math.log(tis_cap)
    w_bt = log_rho_bt.clamp(-_MAX_LOG, log_cap).exp()
    return w_bt, _metrics("tis", w_bt, log_rho_bt > log_cap, mask_bt, tis_level)


@CORRECTIONS.register("mis")
def masked_is(
    old_logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    mis_level: str = "sequence",
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked importance sampling (Liu, Yao et al. 2025): w = rho inside the band [lo, hi], 0 outside,
    per token (IcePop) or per sequence (Seq-MIS). Band 0.5 / 2.0: SkyRL's sequence product-mask
    defaults. Returns weights [B, T] (detached), ``algo/mis_frac`` (share masked), ``algo/is_ess``."""
    assert 0 < mis_low <= 1 <= mis_high, f"need 0 < mis_low <= 1 <= mis_high, got {mis_low}, {mis_high}"
    log_rho_bt = _log_rho(old_logp_bt, behav_logp_bt, mask_bt, mis_level)
    keep_bt = (log_rho_bt >= math.log(mis_low)) & (log_rho_bt <= math.log(mis_high))
    w_bt = torch.where(keep_bt, log_rho_bt.clamp(max=math.log(mis_high)).exp(), torch.zeros_like(log_rho_bt))
    return w_bt, _metrics("mis", w_bt, ~keep_bt, mask_bt, mis_level)
