"""Pure tensor math of RL post-training: advantages, policy losses, loss aggregation.

One registry per kind; every entry is a pure function (tensors in, ``(value, metrics)`` out).
"""

from tidal.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")

from tidal.algo import advantages as _advantages  # noqa: E402,F401  (registers)
from tidal.algo import losses as _losses  # noqa: E402,F401  (registers)
