"""Policy losses: per-token policy-gradient terms, weighted and aggregated into one scalar.

Every loss is ``fn(logp_bt, old_logp_bt, adv, mask_bt, *, knobs) -> (loss, metrics)``:
- ``logp_bt`` [B, T]: the trainer's log-probs of the sampled tokens, with grad;
- ``old_logp_bt`` [B, T]: the log-probs the ratio is taken against (the behaviour policy's from the
  engine, or the trainer's own before the update); never differentiated;
- ``adv``: [B] (one per sequence, broadcast over tokens) or [B, T];
- ``mask_bt``: 1 on response tokens. Masked positions get exactly zero loss and zero gradient, and
  may hold anything in every input, -inf or NaN included (each loss first selects its inputs with
  ``zero_outside``: multiplying by the mask instead would turn 0 * inf into NaN);
- ``is_weight_bt=``: optional per-token weight (e.g. a ``CORRECTIONS`` weight), detached, so every
  loss composes with every correction. Token-level losses multiply each token's loss by it; the
  sequence-level objectives (``gspo``, ``gmpo``, attribute ``weight_scope = "sequence"``) first reduce
  it to one weight per sequence, its geometric mean over the response tokens;
- ``agg=`` and its inputs (``group_ids_b``, ``max_gen_len``, ``agg_weights_bt``): see
  ``tidal.algo.aggregation``.
Metrics are plain floats: clip fractions, ratio statistics, ``algo/approx_kl`` (mean of
log(old / new)) and ``algo/ess`` (normalized ESS of the importance weights the loss applies).

Ratios are exp of log-ratios clamped to +-20: finite even for wildly stale tokens; beyond that the
ratio is constant (no gradient through it), which only matters where clipping already stops it.
"""

from __future__ import annotations

import torch

from tidal.algo import POLICY_LOSSES
from tidal.algo.aggregation import aggregate, masked_mean, zero_outside

__all__ = ["masked_mean", "ppo_clip", "cispo", "gspo", "gmpo", "sapo", "decoupled_ppo", "reinforce"]

_MAX_LOG = 20.0


def _broadcast_adv(adv: torch.Tensor, logp_bt: torch.Tensor, mask_bt: torch.Tensor | None = None) -> torch.Tensor:
    """The advantage as [B, T], detached; 0 outside ``mask_bt`` when it is given."""
    adv = torch.as_tensor(adv).to(logp_bt).detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp_bt)
    assert adv.shape == logp_bt.shape, f"adv must be [B] or [B, T]={tuple(logp_bt.shape)}, got {tuple(adv.shape)}"
    return adv if mask_bt is None else zero_outside(adv, mask_bt)


def _zero_padding(mask_bt: torch.Tensor, *tensors_bt: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each [B, T] input with its padding replaced by 0 (``zero_outside``), None passing through: what
    every loss does first, so that -inf or NaN padding changes neither its value nor any gradient."""
    return tuple(zero_outside(x, mask_bt) for x in tensors_bt)


def _sequence_adv(adv: torch.Tensor, logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence [B]: ``adv`` itself, or a [B, T] advantage's mean over each sequence's
    response tokens (for objectives defined with one advantage per sequence, as AReaL's sequence level)."""
    adv = torch.as_tensor(adv).to(logp_bt).detach()
    if adv.dim() == 1:
        return adv
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    return adv_bt.sum(-1) / mask_bt.sum(-1).clamp(min=1)


def _sequence_is_weight(is_weight_bt: torch.Tensor | None, mask_bt: torch.Tensor) -> torch.Tensor | None:
    """One importance weight per sequence for the sequence-level objectives, broadcast to [B, T]: the
    geometric mean of the per-token weights over the response tokens, exp(mean_t log w_t).

    Why the geometric mean: GSPO's and GMPO's ratios are length-normalized sequence ratios,
    (pi / pi_old)^(1/|y|); the same normalization of the sampler's sequence weight prod_t rho_t is
    exp(mean_t log rho_t). Uncapped, the product with the loss's own ratio is then (pi / pi_behav)^(1/|y|),
    the same objective against the policy that sampled. Weighting each token's term by its own w_t
    instead (the GSPO-token form) gives GSPO-token's gradient times per-token weights, not a
    sequence-level objective (issue 17). A weight constant over a sequence (sequence-level TIS/MIS)
    passes through unchanged; one zero weight (token-level MIS) drops the whole sequence."""
    if is_weight_bt is None:
        return None
    keep_bt = mask_bt > 0
    log_w_bt = torch.where(keep_bt, is_weight_bt.detach().log(), 0.0)
    log_w_b = log_w_bt.sum(-1) / keep_bt.sum(-1).clamp(min=1)
    return log_w_b.exp().unsqueeze(-1).expand_as(mask_bt)


def _check(name: str, value: float, ok: bool, requirement: str) -> None:
    """A knob value the math cannot use is a ValueError naming the knob (its ``AlgoConfig`` field)."""
    if not ok:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt) -> torch.Tensor:
    if is_weight_bt is not None:
        loss_bt = loss_bt * is_weight_bt.detach()
    return aggregate(
        loss_bt, mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=max_gen_len, weights_bt=agg_weights_bt
    )


# The losses' metrics are 0-dim tensors on the loss's device, not floats: the trainer sums them over its
# micro-batches and reads them all once per step, so no micro-batch waits for the device (issue 51).


def _frac(flag_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    return masked_mean(flag_bt.float(), mask_bt)


def _masked_extreme(values_bt: torch.Tensor, keep_bt: torch.Tensor, largest: bool, empty: float) -> torch.Tensor:
    """max (or min) of ``values_bt`` where ``keep_bt``, ``empty`` when nothing is kept; no boolean indexing,
    which would wait for the device to count the kept entries."""
    if values_bt.numel() == 0:
        return values_bt.new_tensor(empty)
    fill = float("-inf") if largest else float("inf")
    masked = torch.where(keep_bt, values_bt, fill)
    extreme = masked.amax() if largest else masked.amin()
    return torch.where(keep_bt.any(), extreme, values_bt.new_tensor(empty))


def _ess(weight_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """``correction.effective_sample_size`` as a 0-dim float64 tensor, computed without leaving the device:
    (sum w)^2 / (n sum w^2) over the masked entries; 1 with none, 0 when every weight is 0."""
    keep = mask_bt.bool()
    w = torch.where(keep, weight_bt.detach().double(), 0.0)  # zeros add nothing to either sum
    n, sq = keep.sum(), (w * w).sum()
    one, zero = w.new_tensor(1.0), w.new_tensor(0.0)
    return torch.where(n == 0, one, torch.where(sq == 0, zero, w.sum() ** 2 / (n * sq)))


def _ratio_metrics(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor,
                   weight_bt: torch.Tensor) -> dict[str, torch.Tensor]:
    """Ratio statistics over response tokens, approx KL and the ESS of the applied weights."""
    ratio_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    keep = mask_bt.bool()
    return {
        "algo/ratio_mean": masked_mean(ratio_bt, mask_bt),
        "algo/ratio_max": _masked_extreme(ratio_bt, keep, largest=True, empty=1.0),
        "algo/ratio_min": _masked_extreme(ratio_bt, keep, largest=False, empty=1.0),
        "algo/approx_kl": masked_mean(-log_ratio_bt, mask_bt),
        "algo/ess": _ess(weight_bt, mask_bt),
    }


def _clipped_surrogate(log_ratio_bt, adv_bt, mask_bt, eps_low, eps_high, dual_clip):
    """PPO's per-token loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), capped at -c A for A < 0
    when ``dual_clip`` = c is set, and its clip metrics."""
    loss_bt, was_clipped = _ppo_surrogate(log_ratio_bt, adv_bt, eps_low, eps_high)
    with torch.no_grad():
        metrics = {
            "algo/clip_frac": _frac(was_clipped, mask_bt),
            "algo/clip_frac_low": _frac(was_clipped & (adv_bt < 0), mask_bt),
            "algo/clip_frac_high": _frac(was_clipped & (adv_bt > 0), mask_bt),
        }
    if dual_clip is not None:
        assert dual_clip > 1.0, f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}"
        cap_bt = -adv_bt * dual_clip
        with torch.no_grad():
            metrics["algo/dual_clip_frac"] = _frac((adv_bt < 0) & (loss_bt > cap_bt), mask_bt)
        loss_bt = torch.where(adv_bt < 0, torch.minimum(loss_bt, cap_bt), loss_bt)
    return loss_bt, metrics


def _ppo_surrogate(log_ratio_bt, adv_bt, eps_low, eps_high) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, and where the clipped term won (no
    gradient there)."""
    ratio_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    unclipped_bt = -adv_bt * ratio_bt
    clipped_bt = -adv_bt * ratio_bt.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped_bt, clipped_bt), (clipped_bt > unclipped_bt).detach()


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = 3.0,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) per token, r = pi / pi_old:

        loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    with DAPO's decoupled "clip-higher" range eps_low = 0.2, eps_high = 0.28 (arXiv 2503.14476
    sec. 3.1) and, for A < 0, dual clip: loss_t <= -c A_t with c = 3 (Ye et al. 2020, arXiv
    1912.09729), so a token whose ratio exploded cannot dominate. Default aggregation: DAPO's
    ``token_mean``."""
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = logp_bt - old_logp_bt.detach()
    loss_bt, metrics = _clipped_surrogate(log_ratio_bt, adv_bt, mask_bt, eps_low, eps_high, dual_clip)
    loss = _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        weight_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp() * (1 if is_weight_bt is None else is_weight_bt)
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, weight_bt))
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low_is: float = 1.0,
    eps_high_is: float = 4.0,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, sec. 3.1, eq. 4-5): clip the importance weight, not the
    update, and stop its gradient:

        loss_t = -sg(clip(r_t, 1 - eps_low_is, 1 + eps_high_is)) A_t log pi(y_t)

    Every token keeps a gradient (PPO zeroes clipped tokens, often the rare "However"/"Wait" forks).
    MiniMax sets no lower bound in practice and tunes only the upper one without publishing it:
    eps_low_is = 1 (bound 0), eps_high_is = 4 (bound 5, ScaleRL arXiv 2510.13786). The loss value is
    not a surrogate objective; its gradient is the CISPO gradient. Aggregation: ``token_mean``
    (MiniMax normalizes by the total token count, eq. 4)."""
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = (logp_bt - old_logp_bt).detach()
    ratio_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    weight_bt = ratio_bt.clamp(1.0 - eps_low_is, 1.0 + eps_high_is)
    loss_bt = -weight_bt * adv_bt * logp_bt
    loss = _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        metrics = {
            "algo/clip_frac": _frac(weight_bt != ratio_bt, mask_bt),
            "algo/clip_frac_low": _frac(ratio_bt < 1.0 - eps_low_is, mask_bt),
            "algo/clip_frac_high": _frac(ratio_bt > 1.0 + eps_high_is, mask_bt),
        }
        metrics.update(_ratio_metrics(log_ratio_bt, mask_bt, ratio_bt * (1 if is_weight_bt is None else is_weight_bt)))
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "seq_mean_token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """GSPO (Qwen, arXiv 2507.18071): one length-normalized (geometric-mean) ratio per sequence,

        s_i = exp(mean_t (logp - old_logp)),   loss_i = -w_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    clipped with its own small range, 3e-4 / 4e-4 (sec. 5.1), averaged over sequences (eq. 5: the
    default ``seq_mean_token_mean``). Implemented in the GSPO-token form (sec. 4.3),
    s_it = sg(s_i) pi(y_t) / sg(pi(y_t)): with a per-sequence advantage [B] its value and gradient
    equal GSPO's exactly; a token-level advantage [B, T] gives GSPO-token. ``is_weight_bt`` enters as
    one weight per sequence, w_i = its geometric mean over the response tokens (``_sequence_is_weight``),
    so a token-level correction keeps the objective sequence-level. Clip fraction is per token
    (per sequence for [B] advantages, as every token of a sequence shares s_i)."""
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    seq_log_ratio_b = zero_outside(logp_bt - old_logp_bt, mask_bt).sum(-1) / mask_bt.sum(-1).clamp(min=1)
    log_s_bt = logp_bt - logp_bt.detach() + seq_log_ratio_b.detach().unsqueeze(-1)
    loss_bt, metrics = _clipped_surrogate(log_s_bt, adv_bt, mask_bt, eps_low, eps_high, None)
    seq_weight_bt = _sequence_is_weight(is_weight_bt, mask_bt)
    loss = _finish(loss_bt, mask_bt, seq_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        seq_ratio_b = seq_log_ratio_b.detach().clamp(-_MAX_LOG, _MAX_LOG).exp()
        metrics.update(_ratio_metrics((logp_bt - old_logp_bt).detach(), mask_bt, torch.ones_like(mask_bt)))
        metrics.update(_sequence_ratio_metrics(seq_ratio_b, seq_weight_bt, mask_bt))
    return loss, metrics


gspo.weight_scope = "sequence"


def _sequence_ratio_metrics(seq_ratio_b, seq_weight_bt, mask_bt) -> dict[str, torch.Tensor]:
    """Mean sequence ratio over sequences with response tokens, and the ESS of the sequence weights
    the loss applies (ratio times the reduced correction weight)."""
    rows = (mask_bt.sum(-1) > 0).float()
    weight_b = seq_ratio_b if seq_weight_bt is None else seq_ratio_b * seq_weight_bt[:, 0]
    return {
        "algo/seq_ratio_mean": (seq_ratio_b * rows).sum() / rows.sum().clamp(min=1),
        "algo/ess": _ess(weight_b, rows),
    }


@POLICY_LOSSES.register("gmpo")
def gmpo(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "seq_mean_token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): maximize the geometric mean of the
    token-level clipped objectives instead of their arithmetic mean, so one outlier ratio moves the
    sequence's objective by its |y|-th root only. Clipping is per token and in log space:

        c_t = min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high)) * sgn(A)
        s_i = exp(mean_t c_t),   loss_i = -w_i A_i s_i

    i.e. log r_t capped at eps_high for A >= 0 and floored at -eps_low for A < 0 (PPO's pessimism,
    per token). The paper's range is (e^-0.4, e^0.4), wider than PPO's, which the geometric mean makes
    stable (sec. 3, ablations): eps_low = eps_high = 0.4 here are log-space bounds, unlike
    ``ppo_clip``'s. Default aggregation ``seq_mean_token_mean``: the paper's mean over sequences.

    Written in the token form sg(s_i) exp(c_t - sg(c_t)), so its value is s_i and its gradient through
    token t is s_i / |y_i| where c_t is unclipped, 0 where clipped: exactly GMPO's. GMPO has one
    advantage per sequence; a [B, T] advantage is averaged over the sequence's response tokens.
    ``is_weight_bt`` enters as one weight per sequence, its geometric mean w_i
    (``_sequence_is_weight``): the geometric mean of w_t r_t splits into w_i s_i."""
    _check("eps_low", eps_low, eps_low >= 0, ">= 0 (a log-space bound)")
    _check("eps_high", eps_high, eps_high >= 0, ">= 0 (a log-space bound)")
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_b = _sequence_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = (logp_bt - old_logp_bt.detach()).clamp(-_MAX_LOG, _MAX_LOG)
    positive_b1 = (adv_b >= 0).unsqueeze(-1)
    clipped_bt = torch.where(positive_b1, log_ratio_bt.clamp(max=eps_high), log_ratio_bt.clamp(min=-eps_low))
    keep_bt = mask_bt > 0
    seq_log_b = torch.where(keep_bt, clipped_bt, 0.0).sum(-1) / mask_bt.sum(-1).clamp(min=1)
    log_s_bt = clipped_bt - clipped_bt.detach() + seq_log_b.detach().unsqueeze(-1)
    loss_bt = -adv_b.unsqueeze(-1) * log_s_bt.exp()
    seq_weight_bt = _sequence_is_weight(is_weight_bt, mask_bt)
    loss = _finish(loss_bt, mask_bt, seq_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        was_clipped = clipped_bt != log_ratio_bt
        metrics = {
            "algo/clip_frac": _frac(was_clipped, mask_bt),
            "algo/clip_frac_low": _frac(was_clipped & ~positive_b1, mask_bt),
            "algo/clip_frac_high": _frac(was_clipped & positive_b1, mask_bt),
        }
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, torch.ones_like(mask_bt)))
        metrics.update(_sequence_ratio_metrics(seq_log_b.detach().exp(), seq_weight_bt, mask_bt))
    return loss, metrics


gmpo.weight_scope = "sequence"


@POLICY_LOSSES.register("sapo")
def sapo(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "seq_mean_token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347): a smooth, temperature-
    controlled gate on the token ratio instead of a hard clip,

        loss_t = -f(r_t) A_t,   f(r) = (4 / tau) sigmoid(tau (r - 1)),   tau = tau_pos if A_t > 0 else tau_neg

    Its gradient is -4 sigma (1 - sigma) r A grad log pi: exactly the policy gradient at r = 1 (the 4 /
    tau normalization), decaying smoothly as r leaves 1, so an off-policy token is down-weighted
    rather than cut off and the rest of its sequence keeps learning (PPO and GSPO drop it entirely).
    tau_neg > tau_pos makes negative-advantage updates, which raise many unsampled logits, decay
    faster. Defaults are the paper's, tau_pos = 1.0, tau_neg = 1.05; aggregation ``seq_mean_token_mean``,
    the paper's 1/G sum_i 1/|y_i| sum_t. ``algo/soft_gate_mean`` is the mean gradient weight
    4 sigma (1 - sigma) over response tokens (1 on-policy)."""
    _check("sapo_tau_pos", sapo_tau_pos, sapo_tau_pos > 0, "> 0 (a gate temperature)")
    _check("sapo_tau_neg", sapo_tau_neg, sapo_tau_neg > 0, "> 0 (a gate temperature)")
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    log_ratio_bt = logp_bt - old_logp_bt.detach()
    ratio_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    tau_bt = torch.where(adv_bt > 0, sapo_tau_pos, sapo_tau_neg).to(ratio_bt)
    gate_bt = torch.sigmoid(tau_bt * (ratio_bt - 1.0))
    loss_bt = -(4.0 / tau_bt) * gate_bt * adv_bt
    loss = _finish(loss_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        gate_weight_bt = 4 * gate_bt * (1 - gate_bt)
        metrics = {"algo/clip_frac": 0.0, "algo/soft_gate_mean": masked_mean(gate_weight_bt, mask_bt)}
        weight_bt = ratio_bt * (1 if is_weight_bt is None else is_weight_bt)
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, weight_bt))
    return loss, metrics


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    prox_logp_bt: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = 5.0,
    behav_cap_mode: str = "mask",
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Decoupled PPO (AReaL, arXiv 2505.24298, its decoupled objective): for stale samples, trust-region clip against
    the proximal policy pi_prox (the trainer's weights before this update) and correct the sampling
    with the behaviour weight pi_prox / pi_behav, here ``old_logp_bt`` = behaviour log-probs:

        loss_t = -(pi_prox / pi_behav) min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t),  u_t = pi / pi_prox

    The behaviour weight is capped at ``behav_weight_cap`` (AReaL's ``behav_imp_weight_cap``, 5 in its
    configs): ``mask`` drops tokens above it (AReaL's implementation), ``truncate`` uses min(w, cap).
    AReaL clips symmetrically at 0.2 and has dual clip off by default. With ``prox_logp_bt`` None
    (or equal to the behaviour log-probs) the weight is 1 and this is exactly ``ppo_clip``."""
    assert behav_cap_mode in ("mask", "truncate"), f"behav_cap_mode must be mask/truncate, got {behav_cap_mode!r}"
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    prox_bt = (old_logp_bt if prox_logp_bt is None else zero_outside(prox_logp_bt, mask_bt)).detach()
    log_behav_w_bt = (prox_bt - old_logp_bt).detach()
    behav_w_bt = log_behav_w_bt.clamp(-_MAX_LOG, _MAX_LOG).exp()
    over_cap_bt = torch.zeros_like(mask_bt, dtype=torch.bool)
    if behav_weight_cap is not None:
        over_cap_bt = behav_w_bt > behav_weight_cap
        capped_bt = torch.zeros_like(behav_w_bt) if behav_cap_mode == "mask" else behav_w_bt.clamp(max=behav_weight_cap)
        behav_w_bt = torch.where(over_cap_bt, capped_bt, behav_w_bt)
    log_ratio_bt = logp_bt - prox_bt
    loss_bt, metrics = _clipped_surrogate(log_ratio_bt, adv_bt, mask_bt, eps_low, eps_high, dual_clip)
    loss = _finish(loss_bt * behav_w_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        weight_bt = log_ratio_bt.clamp(-_MAX_LOG, _MAX_LOG).exp() * behav_w_bt
        weight_bt = weight_bt * (1 if is_weight_bt is None else is_weight_bt)
        metrics.update(_ratio_metrics(log_ratio_bt.detach(), mask_bt, weight_bt))
        metrics["algo/behav_weight_mean"] = masked_mean(behav_w_bt, mask_bt)
        metrics["algo/behav_cap_frac"] = _frac(over_cap_bt, mask_bt)
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    is_weight_bt: torch.Tensor | None = None,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """REINFORCE with a baseline (Williams 1992), loss_t = -A_t log pi(y_t): no ratio, on-policy.
    ``old_logp_bt`` only feeds the ratio metrics (how off-policy the batch was); correct staleness
    with ``is_weight_bt``. Aggregation: ``token_mean``."""
    logp_bt, old_logp_bt, is_weight_bt = _zero_padding(mask_bt, logp_bt, old_logp_bt, is_weight_bt)
    adv_bt = _broadcast_adv(adv, logp_bt, mask_bt)
    loss = _finish(-adv_bt * logp_bt, mask_bt, is_weight_bt, agg, group_ids_b, max_gen_len, agg_weights_bt)
    with torch.no_grad():
        weight_bt = torch.ones_like(logp_bt) if is_weight_bt is None else is_weight_bt
        metrics = {"algo/clip_frac": 0.0}
        metrics.update(_ratio_metrics((logp_bt - old_logp_bt).detach(), mask_bt, weight_bt))
    return loss, metrics
