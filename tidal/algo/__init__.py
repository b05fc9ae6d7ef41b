"""Pure tensor math of RL post-training: advantages, policy losses, aggregation, KL, off-policy corrections.

One registry per kind; every entry is a pure function with explicit keyword-only knobs whose defaults
are its paper's (docs/algorithms.md lists them all):

    adv_b = ADVANTAGES["grpo"](rewards_b, group_ids_b, adv_eps=1e-6)                    # float[B]
    loss, metrics = POLICY_LOSSES["cispo"](logp_bt, old_logp_bt, adv_b, mask_bt, agg="token_mean")
    w_bt, metrics = CORRECTIONS["tis"](old_logp_bt, behav_logp_bt, mask_bt, tis_cap=2.0)
    loss = aggregate(loss_bt, mask_bt, agg="group_length", group_ids_b=group_ids_b)
    keep_bt, metrics = high_entropy_mask(entropy_bt, mask_bt, top_entropy_frac=0.2)  # train the forking tokens
    adv_bt, returns_bt = VALUE_ADVANTAGES["gae"](rewards_b, values_bt, mask_bt, gamma=1.0, lam=1.0)  # PPO + critic

``bind(fn, cfg, **data)`` fills in what an ``AlgoConfig`` (and per-batch data) has for ``fn``, so a
trainer calls whatever is configured without branching on names.
"""

from tidal.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("KL estimator")
CORRECTIONS: Registry = Registry("off-policy correction")
VALUE_ADVANTAGES: Registry = Registry("value-based advantage estimator")
"""Per-token estimators from a learned critic (``gae``): ``fn(rewards_b, values_bt, mask_bt) -> (adv_bt,
returns_bt)``, a sibling of ``ADVANTAGES`` because they need values and return the critic's targets."""

# The modules register their entries on import (they import the registries above).
from tidal.algo import covariance as _covariance  # noqa: E402,F401
from tidal.algo import losses as _losses  # noqa: E402,F401
from tidal.algo.advantages import advantage_metrics  # noqa: E402
from tidal.algo.aggregation import aggregate, aggregation_weights, masked_mean  # noqa: E402
from tidal.algo.config import AlgoConfig, bind  # noqa: E402
from tidal.algo.correction import (  # noqa: E402
    effective_sample_size,
    effective_sample_size_log,
    ess_lr_scale,
    masked_is,
    mismatch_metrics,
    rejection_only,
    sequence_log_ratio,
    truncated_is,
)
from tidal.algo.distill import distill_advantage  # noqa: E402
from tidal.algo.entropy import entropy_loss, high_entropy_mask  # noqa: E402
from tidal.algo.kl import (  # noqa: E402
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_is,
    kl_loss,
    kl_reward_penalty,
    kl_reward_penalty_tokens,
)
from tidal.algo.value import explained_variance, value_loss  # noqa: E402

__all__ = [
    "ADVANTAGES",
    "distill_advantage",
    "POLICY_LOSSES",
    "LOSS_AGGREGATIONS",
    "KL_ESTIMATORS",
    "CORRECTIONS",
    "VALUE_ADVANTAGES",
    "AlgoConfig",
    "bind",
    "aggregate",
    "aggregation_weights",
    "masked_mean",
    "advantage_metrics",
    "effective_sample_size",
    "effective_sample_size_log",
    "mismatch_metrics",
    "ess_lr_scale",
    "sequence_log_ratio",
    "truncated_is",
    "masked_is",
    "rejection_only",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_is",
    "kl_loss",
    "kl_reward_penalty",
    "kl_reward_penalty_tokens",
    "entropy_loss",
    "high_entropy_mask",
    "value_loss",
    "explained_variance",
]
