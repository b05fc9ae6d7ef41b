"""Off-policy corrections for the engine/trainer mismatch, effective sample size, VCPO's lr scale.

The engine samples token y_t with log-prob ``behav_logp`` (pi_behav); the trainer, with the very
same weights, scores it ``old_logp`` (pi_old). Kernels, precision and batch composition make the
two differ, so "on-policy" training is secretly off-policy (Yao et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", 2025, fengyao.notion.site/off-policy-rl). A correction
turns the ratio rho_t = pi_old / pi_behav into a per-token weight [B, T] that multiplies any policy
loss's per-token term (``is_weight_bt=``):

- ``tis`` (truncated IS, Yao et al.): token level w_t = clip(rho_t, floor, C); sequence level
  w = clip(prod_t rho_t, floor, C) for every token of the sequence. C = 2 in their experiments; the
  floor (slime's ``tis_clip_low``) is 0 unless set.
- ``mis`` (masked IS; Liu, Yao et al., "When Speed Kills Stability: Demystifying RL Collapse from
  the Training-Inference Mismatch", 2025; token-level: IcePop): w = rho if lo <= rho <= hi else 0,
  per token or per sequence. Instead of shrinking outliers it drops them, which keeps the kept
  ones unbiased.
- ``reject``: weight 1 on what the rejection knobs below keep, 0 on the rest (rejection without
  reweighting: verl's RS-only presets, DeepSeek-V3.2's off-policy sequence masking).

Both ``tis`` and ``mis`` also take a ``geometric`` level: rho_geo = exp(mean_t log rho_t), the
per-token geometric mean of the sequence ratio, which does not grow with length the way the product
does (verl's and slime's ``geometric`` level; its useful band is tight, e.g. 0.999-1.001).

Rejections, shared by ``tis``, ``mis`` and ``reject`` (each off by default) and applied after the
correction's own weight; a rejected token gets weight 0:
- ``rs_stat`` / ``rs_threshold``: a divergence between pi_behav and pi_old per token (``token_k2``,
  ``token_k3``), its mean or maximum over the sequence (``seq_mean_k*``, ``seq_max_k*``, the max
  being Trust Region Masking's criterion, Li et al., arXiv 2512.23075), or the sequence's largest
  token ratio (``seq_max_ratio``); k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho, both estimating
  KL(pi_behav || pi_old) from the engine's samples (verl's ``rollout_rs`` options).
- ``is_veto_threshold``: drop a whole sequence if any of its tokens has rho < threshold (verl's
  ``rollout_is_veto_threshold``, 1e-4 in its examples): one catastrophic token poisons the sequence.
- ``offpolicy_mask_delta``: DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556): drop a
  sequence when its advantage is negative and mean_t log(pi_behav / pi_old) > delta. Negative
  samples the policy has drifted from are the ones whose gradient destabilizes training; positive
  ones are kept whatever their drift. Needs the advantages, passed as data (``adv=``).
- ``is_batch_norm``: divide the weights by their mean over the call's response tokens (over its
  sequences at sequence/geometric level), so they average 1 (verl's ``rollout_is_batch_normalize``);
  rejected tokens count as 0 in that mean, which makes the loss a self-normalized IS estimate.

Every weight is detached (a constant in the loss), 0 on tokens outside ``mask_bt``, and computed in
log space, so extreme log-ratios (a sequence product of many tokens) neither overflow nor give NaN.
With old == behav every correction is exactly 1 on response tokens: a no-op.

Effective sample size ESS = (sum w)^2 / (n sum w^2), normalized to (0, 1]: 1 when all weights are
equal, 1/n when one dominates. VCPO (Huang et al., arXiv 2602.17616) finds collapse of asynchronous
RL is preceded by ESS drops and scales the step with it (``ess_lr_scale``).
"""

from __future__ import annotations

import math

import torch

from tidal.algo import CORRECTIONS
from tidal.algo.aggregation import masked_mean

_MAX_LOG = 20.0  # |log ratio| beyond this is clamped before exp (e^20 ~ 5e8): finite, still extreme


def mismatch_metrics(logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor, versions_bt: torch.Tensor,
                     mask_bt: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """The engine/trainer numeric gap on the tokens sampled by the weights the trainer holds (``version``; stale
    tokens differ because the policy moved, not because of numerics), as device tensors ({} when there are none):
    the mean and largest absolute log-prob gap; KL(engine || trainer) by the k3 estimator over the engine's samples,
    ``r - 1 - log r`` with r = pi_train / pi_engine; and the share of extreme tokens, whose ratio either way exceeds
    2. The last two are what R3 reports (Ma et al., arXiv 2510.11370, sec. 2: k3 KL; the extreme token
    distribution F(tau) at tau = 2)."""
    fresh = mask_bt * (versions_bt == version).float()
    if not fresh.any():
        return {}
    log_r = logp_bt - behav_logp_bt
    gap = log_r.abs()
    k3 = torch.expm1(log_r.clamp(max=20)) - log_r
    return {"train/logp_mismatch_mean": masked_mean(gap, fresh), "train/logp_mismatch_max": gap[fresh.bool()].max(),
            "train/logp_mismatch_kl": masked_mean(k3, fresh),
            "train/extreme_token_frac": masked_mean((gap > math.log(2)).float(), fresh)}


def sequence_log_ratio(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """log prod_t (p_t / q_t) over response tokens: sum_t mask * (logp - ref_logp), one per sequence.
    A selection, not a product: padded log-probs may be -inf, and 0 * (-inf - -inf) would be NaN."""
    valid_bt = mask_bt > 0
    return (torch.where(valid_bt, logp_bt - ref_logp_bt, 0.0) * mask_bt).sum(-1)


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


LEVELS = ("token", "sequence", "geometric")
RS_STATS = ("token_k2", "token_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "seq_max_ratio")


def _require(ok: bool, key: str, requirement: str, value: object) -> None:
    """A knob value a correction cannot use is a ValueError naming the knob (its ``AlgoConfig`` field)."""
    if not ok:
        raise ValueError(f"{key} must be {requirement}, got {value!r}")


def _row_mean(x_bt: torch.Tensor, valid_bt: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its response tokens [B]; 0 for a row without any."""
    return torch.where(valid_bt, x_bt, 0.0).sum(-1) / valid_bt.sum(-1).clamp(min=1)


def _token_log_rho(old_logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor, valid_bt: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_behav) per response token, detached; exactly 0 elsewhere (even where a padded
    log-prob is -inf, which a multiplication by the mask would turn into NaN)."""
    return torch.where(valid_bt, (old_logp_bt - behav_logp_bt).detach(), 0.0)


def _level_log_rho(tok_bt: torch.Tensor, valid_bt: torch.Tensor, level: str, key: str) -> torch.Tensor:
    """Log weight per token [B, T] at ``level``: the token's own log ratio, its sequence's sum (the log of
    the product of ratios) or its sequence's mean over response tokens (the log of their geometric mean)."""
    _require(level in LEVELS, key, f"one of {LEVELS}", level)
    if level == "token":
        return tok_bt
    seq_b = tok_bt.sum(-1) if level == "sequence" else _row_mean(tok_bt, valid_bt)
    return seq_b[:, None].expand_as(tok_bt)


def _share(hit_bt: torch.Tensor, valid_bt: torch.Tensor, per_sequence: bool) -> float:
    """Share of sequences (rows with response tokens) with a hit on any response token, or of tokens hit."""
    hit_bt = hit_bt & valid_bt
    if per_sequence:
        rows_b = valid_bt.any(-1)
        return (hit_bt.any(-1).sum() / rows_b.sum().clamp(min=1)).item()
    return (hit_bt.sum() / valid_bt.sum().clamp(min=1)).item()


def _divergence_rejected(tok_bt: torch.Tensor, valid_bt: torch.Tensor, rs_stat: str, rs_threshold: float):
    """Tokens rejected because ``rs_stat`` exceeds ``rs_threshold`` (every token of a rejected sequence for
    the ``seq_*`` statistics). With rho = pi_old / pi_behav, k2 = (log rho)^2 / 2 and k3 = rho - 1 - log rho
    are per-token estimates of KL(pi_behav || pi_old) from the engine's samples (Schulman 2020)."""
    log_rho_bt = tok_bt.clamp(-_MAX_LOG, _MAX_LOG)
    if rs_stat == "seq_max_ratio":
        stat_b, bound = log_rho_bt.masked_fill(~valid_bt, -math.inf).amax(-1), math.log(rs_threshold)
        return (stat_b > bound)[:, None].expand_as(valid_bt)
    where, estimator = rs_stat.rsplit("_", 1)
    k_bt = 0.5 * log_rho_bt**2 if estimator == "k2" else log_rho_bt.exp() - 1 - log_rho_bt
    if where == "token":
        return k_bt > rs_threshold
    if where == "seq_mean":
        stat_b = _row_mean(k_bt, valid_bt)
    else:  # seq_max: Trust Region Masking's criterion, the sequence's worst token
        stat_b = k_bt.masked_fill(~valid_bt, -math.inf).amax(-1)
    return (stat_b > rs_threshold)[:, None].expand_as(valid_bt)


def _vetoed(tok_bt: torch.Tensor, valid_bt: torch.Tensor, threshold: float) -> torch.Tensor:
    """Every token of a sequence in which some response token has rho < ``threshold``."""
    catastrophic_b = ((tok_bt < math.log(threshold)) & valid_bt).any(-1)
    return catastrophic_b[:, None].expand_as(valid_bt)


def _offpolicy_masked(tok_bt: torch.Tensor, valid_bt: torch.Tensor, adv: torch.Tensor, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: tokens with a negative advantage in a sequence whose mean
    log(pi_behav / pi_old) over its response tokens exceeds ``delta``. ``adv`` is [B] or [B, T]."""
    drift_b = -_row_mean(tok_bt, valid_bt)
    adv_bt = torch.as_tensor(adv).detach().to(tok_bt.device)
    adv_bt = (adv_bt if adv_bt.dim() == 2 else adv_bt[:, None]).expand_as(tok_bt)
    return (adv_bt < 0) & (drift_b > delta)[:, None]


def _rejections(tok_bt, valid_bt, *, rs_stat, rs_threshold, is_veto_threshold, offpolicy_mask_delta, adv):
    """(metric name, rejected tokens [B, T], counted per sequence) for each rejection knob that is set."""
    out = []
    if rs_stat is not None:
        _require(rs_stat in RS_STATS, "rs_stat", f"one of {RS_STATS} (or None)", rs_stat)
        if rs_stat == "seq_max_ratio":
            _require(
                rs_threshold > 1,
                "rs_threshold",
                "> 1 for rs_stat=seq_max_ratio (a bound on rho, e.g. 2.0)",
                rs_threshold,
            )
        _require(rs_threshold > 0, "rs_threshold", "> 0", rs_threshold)
        out.append(("rs", _divergence_rejected(tok_bt, valid_bt, rs_stat, rs_threshold), rs_stat.startswith("seq")))
    if is_veto_threshold is not None:
        _require(0 < is_veto_threshold < 1, "is_veto_threshold", "in (0, 1) (or None)", is_veto_threshold)
        out.append(("veto", _vetoed(tok_bt, valid_bt, is_veto_threshold), True))
    if offpolicy_mask_delta is not None:
        _require(offpolicy_mask_delta >= 0, "offpolicy_mask_delta", ">= 0 (or None)", offpolicy_mask_delta)
        if adv is None:
            raise ValueError(
                "offpolicy_mask_delta needs the advantages: call the correction with adv= (the trainer "
                "passes each micro-batch's)"
            )
        out.append(("opsm", _offpolicy_masked(tok_bt, valid_bt, adv, offpolicy_mask_delta), True))
    return out


def _batch_normalize(w_bt: torch.Tensor, valid_bt: torch.Tensor, per_sequence: bool) -> tuple[torch.Tensor, float]:
    """w / mean(w), the mean over response tokens or (``per_sequence``) over sequences, rejected ones
    included as 0; unchanged when that mean is 0 (everything rejected)."""
    if per_sequence:
        rows_b = valid_bt.any(-1)
        mean = _row_mean(w_bt, valid_bt)[rows_b].mean() if rows_b.any() else w_bt.new_zeros(())
    else:
        mean = w_bt[valid_bt].mean() if valid_bt.any() else w_bt.new_zeros(())
    if not mean > 0:
        return w_bt, 1.0
    return w_bt / mean, mean.item()


def _finish(
    w_bt,
    tok_bt,
    valid_bt,
    hits,
    *,
    per_sequence,
    rs_stat,
    rs_threshold,
    is_veto_threshold,
    offpolicy_mask_delta,
    adv,
    is_batch_norm,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The tail every weighting correction shares: its own hit shares (``hits``, counted at its level), the
    rejections, 0 outside the mask, optional batch normalization, and the ESS of the final weights."""
    metrics = {f"algo/{name}_frac": _share(hit_bt, valid_bt, per_sequence) for name, hit_bt in hits.items()}
    keep_bt = valid_bt
    for name, rejected_bt, counted_per_sequence in _rejections(
        tok_bt,
        valid_bt,
        rs_stat=rs_stat,
        rs_threshold=rs_threshold,
        is_veto_threshold=is_veto_threshold,
        offpolicy_mask_delta=offpolicy_mask_delta,
        adv=adv,
    ):
        metrics[f"algo/{name}_frac"] = _share(rejected_bt, valid_bt, counted_per_sequence)
        keep_bt = keep_bt & ~rejected_bt
    w_bt = torch.where(keep_bt, w_bt, 0.0)
    if is_batch_norm:
        w_bt, metrics["algo/is_norm_factor"] = _batch_normalize(w_bt, valid_bt, per_sequence)
    if per_sequence:
        metrics["algo/is_ess"] = effective_sample_size(_row_mean(w_bt, valid_bt)[valid_bt.any(-1)])
    else:
        metrics["algo/is_ess"] = effective_sample_size(w_bt, valid_bt)
    return w_bt, metrics


@CORRECTIONS.register("none")
def no_correction(
    old_logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor, mask_bt: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weight 1 on every response token (0 elsewhere): trust that trainer and engine agree."""
    return (mask_bt > 0).to(old_logp_bt.dtype), {}


@CORRECTIONS.register("tis")
def truncated_is(
    old_logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    tis_level: str = "token",
    tis_cap: float = 2.0,
    tis_floor: float = 0.0,
    rs_stat: str | None = None,
    rs_threshold: float = 0.01,
    is_veto_threshold: float | None = None,
    offpolicy_mask_delta: float | None = None,
    is_batch_norm: bool = False,
    adv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025): w = clip(rho, floor, C), rho = pi_old / pi_behav per
    token, the product over the sequence's tokens (``sequence``) or their geometric mean (``geometric``).
    C = 2 (their default). The floor (0: none, slime's ``tis_clip_low`` default) bounds how far a token the
    engine over-sampled is down-weighted. Then the shared rejections (module docstring).
    Returns weights [B, T] (detached, 0 outside the mask), ``algo/tis_frac`` (share truncated at C),
    ``algo/tis_low_frac`` (share raised to the floor, when it is set), the rejections' shares, ``algo/is_ess``."""
    _require(tis_cap > 0, "tis_cap", "> 0", tis_cap)
    _require(0 <= tis_floor <= min(1.0, tis_cap), "tis_floor", "in [0, min(1, tis_cap)]", tis_floor)
    valid_bt = mask_bt > 0
    tok_bt = _token_log_rho(old_logp_bt, behav_logp_bt, valid_bt)
    log_rho_bt = _level_log_rho(tok_bt, valid_bt, tis_level, "tis_level")
    log_cap = math.log(tis_cap)
    log_floor = max(math.log(tis_floor), -_MAX_LOG) if tis_floor > 0 else -_MAX_LOG
    w_bt = log_rho_bt.clamp(log_floor, log_cap).exp()
    hits = {"tis": log_rho_bt > log_cap}
    if tis_floor > 0:
        hits["tis_low"] = log_rho_bt < log_floor
    return _finish(
        w_bt,
        tok_bt,
        valid_bt,
        hits,
        per_sequence=tis_level != "token",
        rs_stat=rs_stat,
        rs_threshold=rs_threshold,
        is_veto_threshold=is_veto_threshold,
        offpolicy_mask_delta=offpolicy_mask_delta,
        adv=adv,
        is_batch_norm=is_batch_norm,
    )


@CORRECTIONS.register("mis")
def masked_is(
    old_logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    mis_level: str = "sequence",
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    rs_stat: str | None = None,
    rs_threshold: float = 0.01,
    is_veto_threshold: float | None = None,
    offpolicy_mask_delta: float | None = None,
    is_batch_norm: bool = False,
    adv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked importance sampling (Liu, Yao et al. 2025): w = rho inside the band [lo, hi], 0 outside,
    per token (IcePop), per sequence (Seq-MIS) or on the sequence's geometric mean (Geo-MIS: verl's
    ``geometric`` level, whose band is tight, e.g. 0.999 / 1.001). Band 0.5 / 2.0: SkyRL's sequence
    product-mask defaults. Then the shared rejections (module docstring). Returns weights [B, T]
    (detached, 0 outside the mask), ``algo/mis_frac`` (share masked), the rejections' shares, ``algo/is_ess``."""
    _require(0 < mis_low <= 1, "mis_low", "in (0, 1]", mis_low)
    _require(mis_high >= 1, "mis_high", ">= 1", mis_high)
    valid_bt = mask_bt > 0
    tok_bt = _token_log_rho(old_logp_bt, behav_logp_bt, valid_bt)
    log_rho_bt = _level_log_rho(tok_bt, valid_bt, mis_level, "mis_level")
    keep_bt = (log_rho_bt >= math.log(mis_low)) & (log_rho_bt <= math.log(mis_high))
    w_bt = torch.where(keep_bt, log_rho_bt.clamp(max=math.log(mis_high)).exp(), 0.0)
    return _finish(
        w_bt,
        tok_bt,
        valid_bt,
        {"mis": ~keep_bt},
        per_sequence=mis_level != "token",
        rs_stat=rs_stat,
        rs_threshold=rs_threshold,
        is_veto_threshold=is_veto_threshold,
        offpolicy_mask_delta=offpolicy_mask_delta,
        adv=adv,
        is_batch_norm=is_batch_norm,
    )


@CORRECTIONS.register("reject")
def rejection_only(
    old_logp_bt: torch.Tensor,
    behav_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    rs_stat: str | None = None,
    rs_threshold: float = 0.01,
    is_veto_threshold: float | None = None,
    offpolicy_mask_delta: float | None = None,
    is_batch_norm: bool = False,
    adv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection without reweighting: weight 1 on every response token the shared rejections keep, 0 on the
    rest. ``rs_stat=seq_mean_k3, rs_threshold=0.01`` is verl's k3 rejection preset; ``offpolicy_mask_delta``
    alone is DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556). Under any correction tidal's
    trainer takes the loss's ratio against its own proximal log-probs (verl's "decoupled" mode), so the
    engine gap of the kept tokens goes uncorrected; DeepSeek takes the ratio against the sampler instead.
    At least one rejection must be set (otherwise use ``none``). Returns weights [B, T] (detached), the
    rejections' shares and ``algo/is_ess``."""
    if rs_stat is None and is_veto_threshold is None and offpolicy_mask_delta is None:
        raise ValueError(
            "correction 'reject' needs a criterion: set rs_stat, is_veto_threshold or offpolicy_mask_delta"
        )
    valid_bt = mask_bt > 0
    tok_bt = _token_log_rho(old_logp_bt, behav_logp_bt, valid_bt)
    return _finish(
        valid_bt.to(old_logp_bt.dtype),
        tok_bt,
        valid_bt,
        {},
        per_sequence=False,
        rs_stat=rs_stat,
        rs_threshold=rs_threshold,
        is_veto_threshold=is_veto_threshold,
        offpolicy_mask_delta=offpolicy_mask_delta,
        adv=adv,
        is_batch_norm=is_batch_norm,
    )
