"""The algorithm's knobs, each with its default's source, and ``bind``: call a component with them.

Every function in ``tidal.algo`` takes explicit keyword-only parameters with its paper's defaults.
``AlgoConfig`` holds one field per knob; ``bind(fn, cfg, **data)`` passes ``fn`` exactly the fields
(and data tensors) its signature accepts, so a caller never branches on which estimator, loss or
correction is configured::

    adv_b = bind(ADVANTAGES[cfg.advantage], cfg)(rewards_b, group_ids_b)
    loss, metrics = bind(POLICY_LOSSES[cfg.policy_loss], cfg, group_ids_b=g_b)(logp, old, adv, mask)

Two field conventions, declared in the field's metadata:
- ``param``: the name the functions use when it differs from the field's (``loss_agg`` -> ``agg``).
- ``none_means_default``: ``None`` is not passed, so each function keeps its own paper default
  (``eps_low``/``eps_high`` are 0.2/0.28 for ``ppo_clip`` but 3e-4/4e-4 for ``gspo``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal


def _own_default(param: str | None = None) -> dict[str, Any]:
    return {"none_means_default": True, **({"param": param} if param else {})}


@dataclass
class AlgoConfig:
    """Advantage estimator, policy loss, aggregation and corrections by registered name, plus constants."""

    # --- which components (registry names) ---
    advantage: str = "grpo"
    """``ADVANTAGES`` entry. ``grpo``: (r - mean_group) / (std_group + eps) (DeepSeekMath, arXiv 2402.03300
    sec. 4.1.2). Others: ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_token``, ``magistral``, ``vcpo``,
    ``lite_ppo`` (= TRL's ``scale_rewards="batch"``), ``pass_at_k``.;
    or a ``VALUE_ADVANTAGES`` entry, ``gae``: PPO with a learned critic trained alongside the policy
    (``train/critic.py``)."""
    policy_loss: str = "ppo_clip"
    """``POLICY_LOSSES`` entry. ``ppo_clip``: clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) with
    DAPO's decoupled clip range. Others: ``cispo``, ``gspo``, ``gmpo``, ``sapo``, ``clip_cov``, ``kl_cov``,
    ``decoupled_ppo``, ``reinforce``."""
    loss_agg: str | None = field(default=None, metadata=_own_default("agg"))
    """``LOSS_AGGREGATIONS`` entry, passed as ``agg``. None: the loss's paper default (``token_mean``, DAPO
    arXiv 2503.14476 sec. 3.3, for most; ``seq_mean_token_mean`` for ``gspo`` (GSPO eq. 5), ``gmpo`` and
    ``sapo``, whose papers average over sequences)."""
    correction: str = "none"
    """``CORRECTIONS`` entry for the engine/trainer mismatch: ``none``, ``tis`` (truncated IS, Yao et al. 2025),
    ``mis`` (masked IS, Liu, Yao et al. 2025) or ``reject`` (the rejection knobs alone, weight 1 on what they
    keep). Its weight multiplies every loss's per-token term."""

    # --- advantages ---
    adv_eps: float = 1e-6
    """Added to the std before dividing (``grpo``, ``reinforce_pp``, ``magistral``): verl's and slime's 1e-6
    (TRL's is 1e-4, AReaL's 1e-5; the papers divide by the bare std); a group or batch with zero std gets
    advantage 0, never NaN."""
    overlong_filter: bool = False
    """DAPO's overlong filtering (arXiv 2503.14476, sec. 3.4): truncated samples (finish_reason 'length')
    get no loss, so a cut-off answer is not punished for its length; they still count in the baseline."""
    skip_zero_adv_groups: bool = True
    """Drop groups whose rewards are all equal (zero advantage, no gradient): DAPO's dynamic-sampling filter
    (arXiv 2503.14476 sec. 3.2) without re-sampling; the count is logged (``algo/zero_adv_groups``)."""

    # --- policy losses ---
    eps_low: float | None = field(default=None, metadata=_own_default())
    """Lower clip, ratio >= 1 - eps_low. None: the loss's default: 0.2 for ``ppo_clip`` and ``decoupled_ppo``
    (PPO, kept by DAPO sec. 3.1), 3e-4 for ``gspo`` (GSPO, arXiv 2507.18071 sec. 5.1), 1.0 for ``clip_cov``
    (the Entropy Mechanism paper's scripts). ``gmpo`` clips in log space, log ratio >= -eps_low: 0.4 (GMPO,
    arXiv 2507.20673, range (e^-0.4, e^0.4))."""
    eps_high: float | None = field(default=None, metadata=_own_default())
    """Upper clip, ratio <= 1 + eps_high. None: the loss's default: 0.28 for ``ppo_clip`` (DAPO clip-higher,
    sec. 3.1), 0.2 for ``decoupled_ppo`` (AReaL's symmetric 0.2), 4e-4 for ``gspo`` (GSPO sec. 5.1), 1.0 for
    ``clip_cov``. ``gmpo``: log ratio <= eps_high, 0.4 (GMPO)."""
    dual_clip: float | None = 3.0
    """Dual-clip c for negative advantages (Ye et al. 2020, arXiv 1912.09729: c = 3); None disables."""
    eps_low_is: float = 1.0
    """CISPO: IS weight >= 1 - eps_low_is. MiniMax-M1 (arXiv 2506.13585 sec. 3.1) sets no lower bound in
    practice ("a large value"); 1.0 makes the bound 0, which a ratio never crosses."""
    eps_high_is: float = 4.0
    """CISPO: IS weight <= 1 + eps_high_is. MiniMax-M1 tunes it without publishing the value; 4.0 (bound 5)
    is ScaleRL's CISPO setting (arXiv 2510.13786)."""
    sapo_tau_pos: float = 1.0
    """``sapo``: gate temperature for tokens with A > 0, f(r) = (4 / tau) sigmoid(tau (r - 1)); larger decays
    faster off-policy. 1.0 is SAPO's (Qwen, arXiv 2511.20347)."""
    sapo_tau_neg: float = 1.05
    """``sapo``: gate temperature for tokens with A <= 0; SAPO's 1.05 (> tau_pos: negative updates, which
    raise many unsampled logits, are damped faster)."""
    clip_cov_frac: float = 2e-4
    """``clip_cov``: fraction r of response tokens (at least one) drawn from the covariance band whose gradient
    is dropped; 2e-4 (Cui et al., arXiv 2505.22617)."""
    clip_cov_low: float = 1.0
    """``clip_cov``: lower edge of the covariance band Cov_t = (logp_t - mean)(A_t - mean) tokens are drawn
    from; 1.0 (arXiv 2505.22617)."""
    clip_cov_high: float = 5.0
    """``clip_cov``: upper edge of that band; 5.0 (arXiv 2505.22617)."""
    kl_cov_frac: float = 2e-3
    """``kl_cov``: fraction k of response tokens (at least one), those of largest covariance, that get the KL
    penalty; 2e-3 is the paper's Qwen2.5-7B setting (2e-4 for 32B; arXiv 2505.22617)."""
    kl_cov_coef: float = 1.0
    """``kl_cov``: weight beta of the |log r| penalty on those tokens; 1 (arXiv 2505.22617)."""
    behav_weight_cap: float | None = 5.0
    """``decoupled_ppo``: cap on the behaviour weight pi_prox / pi_behav (AReaL, arXiv 2505.24298; 5 in its
    example configs); None: uncapped."""
    behav_cap_mode: Literal["mask", "truncate"] = "mask"
    """``mask``: drop tokens whose behaviour weight exceeds the cap (AReaL's implementation); ``truncate``:
    use min(weight, cap) instead (TIS-style)."""
    max_gen_len: int | None = None
    """``seq_mean_token_sum_norm`` (Dr. GRPO, arXiv 2503.20783 sec. 3.2): the constant that replaces |o_i|,
    the generation budget. None: the batch's padded width T (verl's fallback); set it for a constant."""

    # --- token entropy (tidal.algo.entropy) ---
    entropy_coef: float = 0.0
    """Entropy bonus: add -entropy_coef * aggregate(H) to the loss (A3C arXiv 1602.01783 and PPO arXiv
    1707.06347 eq. 9 use 0.01). 0 (off), as GRPO, DAPO and most LLM recipes; only when > 0 does the trainer
    compute differentiable entropies."""
    top_entropy_frac: float = 1.0
    """Train only this top fraction of response tokens by entropy ("Beyond the 80/20 Rule", arXiv 2506.01939,
    uses 0.2); the others get no policy-loss weight, with every loss. 1.0: every token (off)."""

    # --- KL to a reference policy (Schulman, "Approximating KL divergence", 2020) ---
    kl_coef: float = 0.0
    """Weight of KL(pi || pi_ref). 0: no KL, as DAPO (sec. 2.3), Dr. GRPO and Magistral (sec. 2.1) drop it;
    DeepSeekMath's GRPO used 0.04 (sec. 4.2)."""
    kl_estimator: str = "k3"
    """``KL_ESTIMATORS`` entry: ``k3`` is GRPO's unbiased, low-variance, non-negative estimator (DeepSeekMath
    eq. 4); ``k1`` is the plain log-ratio used as a reward penalty in RLHF PPO."""
    kl_in_reward: bool = False
    """True: subtract kl_coef * sum_t k from each sequence's reward (InstructGPT-style penalty); False: add
    kl_coef * aggregated k to the loss (GRPO)."""

    # --- engine/trainer mismatch corrections ---
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """``tis``: weight per token, min(ratio_t, C) (Yao et al. 2025), per sequence, min(prod_t ratio_t, C), or on the
    sequence's geometric mean, min(exp(mean_t log ratio_t), C) (verl's and slime's ``geometric`` level)."""
    tis_cap: float = 2.0
    """``tis``: the truncation C; Yao et al.'s blog and verl's example use C = 2 for token-level TIS."""
    mis_level: Literal["token", "sequence", "geometric"] = "sequence"
    """``mis``: mask per token (IcePop), per sequence (Seq-MIS, Liu, Yao et al. 2025, which they recommend) or on
    the sequence's geometric-mean ratio (Geo-MIS; it needs a tight band, e.g. verl's 0.999 / 1.001)."""
    mis_low: float = 0.5
    """``mis``: lower edge of the kept ratio band (SkyRL's sequence product-mask default 0.5)."""
    mis_high: float = 2.0
    """``mis``: upper edge of the kept ratio band (SkyRL's sequence product-mask default 2.0)."""

    # --- more advantage estimators and off-policy rejections (issue 17; docs/algorithms.md) ---
    passk_k: int = 4
    """``pass_at_k``: k of the pass@k a group is scored by (Chen et al., arXiv 2508.10751). The paper reports the
    method robust to k and publishes no single default; 4 is tidal's. Must not exceed ``rollout.group_size``."""
    rpp_group_baseline: bool = True
    """``reinforce_pp_token``: subtract the group's mean reward before the returns (REINFORCE++-baseline, the
    paper's variant for several samples per prompt); False: plain REINFORCE++, the batch mean is the baseline."""
    tis_floor: float = 0.0
    """``tis``: lower bound on the truncated weight, w = clip(ratio, floor, C), in [0, min(1, C)]; 0: none
    (slime's ``tis_clip_low`` default)."""
    rs_stat: (
        Literal["token_k2", "token_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "seq_max_ratio"]
        | None
    ) = None
    """``tis``/``mis``/``reject``: reject tokens (``token_*``) or whole sequences whose divergence between
    engine and trainer exceeds ``rs_threshold``: per-token k2 or k3 estimates of KL(pi_behav || pi_old), their
    sequence mean or max (Trust Region Masking, arXiv 2512.23075), or the sequence's largest ratio (verl's
    ``rollout_rs`` options). None: off."""
    rs_threshold: float = 0.01
    """Bound for ``rs_stat``; its scale follows the statistic: 0.01 is verl's k3 rejection preset (a KL), while
    ``seq_max_ratio`` bounds a ratio and needs a value > 1 (e.g. 2.0)."""
    is_veto_threshold: float | None = None
    """``tis``/``mis``/``reject``: drop a whole sequence if any token's ratio pi_old / pi_behav is below this, in
    (0, 1) (verl's ``rollout_is_veto_threshold``, 1e-4 in its examples). None: off."""
    offpolicy_mask_delta: float | None = None
    """``tis``/``mis``/``reject``: DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556): drop a sequence
    with negative advantage whose mean log(pi_behav / pi_old) exceeds delta. 1e-4 is slime's default (we found
    no published DeepSeek value). None: off."""
    is_batch_norm: bool = False
    """``tis``/``mis``/``reject``: rescale the weights to mean 1 over the response tokens (over sequences at
    sequence/geometric level) of each call, rejected ones counted as 0 (verl's ``rollout_is_batch_normalize``).
    The trainer calls a correction once per micro-batch, so with ``trainer.micro_batch_tokens`` set the mean is
    the micro-batch's."""

    # --- VCPO ESS-scaled learning rate (Huang et al. 2026, arXiv 2602.17616) ---
    ess_lr_scaling: bool = False
    """Scale each optimizer step's lr by ``ess_lr_scale(ESS of the minibatch's sequence IS weights)``."""
    ess_base_ratio: float = 1.0
    """ESS ratio at which the lr is unscaled: scale = rule(min(1, ess / base)) (VCPO's default 1.0)."""
    ess_lr_rule: Literal["sqrt", "linear"] = "sqrt"
    """VCPO: sqrt scaling for AdamW-style optimizers (eta_eff proportional to sqrt(ESS/B))."""

    # --- PPO with a learned critic (advantage=gae; Schulman et al. 2015 / 2017) ---
    gamma: float = 1.0
    """Discount per response token of token-level returns, for ``gae`` (arXiv 1506.02438) and
    ``reinforce_pp_token`` (REINFORCE++, arXiv 2501.03262, whose advantage uses 1). 1.0: verl's
    ``algorithm.gamma`` and OpenRLHF's default for LLM RL, where the only reward comes at the end of a
    response of bounded length."""
    lam: float = 1.0
    """GAE lambda: 1 uses the Monte Carlo return (no critic bias, most variance), 0 the one-step TD error.
    1.0 is verl's ``algorithm.lam`` and OpenRLHF's default (TRL: 0.95)."""
    gae_whiten: bool = True
    """Normalize GAE advantages to mean 0, std 1 over the batch's response tokens, as verl does."""
    value_clip: float | None = 0.5
    """Clipped value loss: the prediction may move at most this far from the value the advantages were
    computed with before the clipped error takes over (PPO2 baselines). 0.5: verl's
    ``critic.cliprange_value`` and OpenRLHF's ``--critic.value_clip``; TRL uses 0.2. None: no clipping."""
    vf_coef: float = 1.0
    """Weight of the value loss. The critic has its own optimizer (``critic.optim``), as in verl and
    OpenRLHF, so 1.0; TRL's 0.1 weighs it inside one loss shared with the policy."""

    # --- on-policy distillation (a teacher scores every sampled token; tidal/algo/distill.py) ---
    distill_kl_coef: float = 1.0
    """Weight of the per-token reverse-KL reward -(log pi_behav - log pi_teacher) in each token's advantage
    when a teacher scored the batch (``distill.teacher``; Thinking Machines' on-policy distillation, 2025,
    and GKD, arXiv 2306.13649). 1.0: the post's pure distillation. Unused without a teacher."""
    distill_reward_coef: float = 0.0
    """Weight of the configured estimator's reward advantage added to the distillation advantage (0: the
    teacher's signal alone; > 0 mixes in the verifier, as GKD's RL + distillation objective does)."""

    # --- guidance: demonstrations where every sample failed (tidal/train/guidance.py) ---
    guidance: Literal["none", "all_fail"] = "none"
    """``all_fail``: a group in which no sample reached ``guidance_reward`` gets the task's demonstration as one
    more member, trained at importance ratio 1 (LUFFY's mixed-policy groups, arXiv 2504.14945, spent only where
    the policy fails, as ReLIFT does, arXiv 2506.07527). ``none`` (off): GRPO and DAPO learn from samples only."""
    guidance_reward: float = 1.0
    """The reward a demonstration gets, and the bar a group's samples must all miss for it to get one: tidal's
    success line (held-out accuracy counts reward >= 1.0)."""

    def kwargs_for(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """The fields ``fn`` accepts as keyword arguments, under the names ``fn`` uses."""
        accepted = _keyword_params(fn)
        out = {}
        for f in fields(self):
            name = f.metadata.get("param", f.name)
            value = getattr(self, f.name)
            if name in accepted and not (value is None and f.metadata.get("none_means_default")):
                out[name] = value
        return out


def _keyword_params(fn: Callable[..., Any]) -> set[str]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds}


def bind(fn: Callable[..., Any], cfg: AlgoConfig | None = None, /, **data: Any) -> functools.partial:
    """``fn`` with every config field and ``data`` keyword it accepts filled in (others are ignored).

    ``data`` carries per-batch tensors (``group_ids_b=``, ``prox_logp_bt=``, ``is_weight_bt=``,
    ``lengths_b=`` ...) and wins over config fields of the same name. The result keeps its other
    arguments open: ``bind(POLICY_LOSSES["cispo"], cfg)(logp_bt, old_logp_bt, adv_b, mask_bt)``.
    """
    kwargs = cfg.kwargs_for(fn) if cfg is not None else {}
    accepted = _keyword_params(fn)
    kwargs.update({k: v for k, v in data.items() if k in accepted})
    return functools.partial(fn, **kwargs)
