"""Group filters: which groups carry a learning signal.

A group whose samples all got the same reward has zero advantage under every group-baseline
estimator, so it contributes no gradient. DAPO (arXiv 2503.14476, sec. 3.2) drops such groups and,
with dynamic sampling, keeps drawing until the batch is full (``tidal/system/batching.py``); without
it the trainer still skips them (``algo.skip_zero_adv_groups``).
"""

from __future__ import annotations

from collections.abc import Sequence


def informative(rewards: Sequence[float]) -> bool:
    """True when the rewards are not all equal (a single sample never is informative)."""
    return len(set(rewards)) > 1
