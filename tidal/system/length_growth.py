"""Staged length growth driven by an indicator, not by fixed steps (MiniMax-M1, arXiv 2506.13585).

MiniMax-M1 (sec. 5) grew its output length in stages (40K -> 80K tokens) and moved to the next stage
when the model "converged" at the current one, which they read from the response lengths: when the
99th percentile of generated lengths approaches the current limit, the limit binds and it is time to
raise it. ``rollout.length_growth`` does that: ``stages`` lists the caps (the first is where the run
starts), and after every step the lengths of the samples trained at the current cap are pooled over
the last ``window`` steps; when their ``quantile`` (0.99) is at least ``(1 - within)`` times the cap,
the next stage begins. The window restarts at every change, so each stage runs at least ``window``
steps. The change is logged twice: ``rollout/length_stage`` and ``rollout/length_cap`` in the
metrics, and one line on stderr.

The state (stage, window) is a pure function of the trained samples, updated when a step ends, and
is checkpointed, so a resumed run grows at the same step as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class LengthGrowthConfig:
    """``rollout.length_growth``: when to raise the response budget, from the lengths themselves."""

    stages: list[int] = field(default_factory=list)
    """Successive ``max_new_tokens`` caps, increasing (e.g. ``[8, 16, 32]``); empty: off (then
    ``rollout.length_schedule`` or ``rollout.max_new_tokens`` sets the budget)."""
    window: int = 5
    """Steps whose response lengths are pooled for the indicator (and the least steps per stage)."""
    quantile: float = 0.99
    """Which quantile of the pooled lengths is compared with the cap (MiniMax-M1: the 99th percentile)."""
    within: float = 0.1
    """Grow when the quantile is within this fraction of the cap (>= (1 - within) x cap); our default,
    the paper does not give its margin."""


def quantile(values: Sequence[int], q: float) -> int:
    """Nearest-rank quantile: the smallest value with at least ``q`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class LengthGrowth:
    """The current stage and the window of lengths behind the indicator."""

    def __init__(self, cfg: LengthGrowthConfig):
        self.cfg = cfg
        self.stage = 0
        self.window: list[list[int]] = []  # per step, the trained samples' response lengths

    @property
    def cap(self) -> int:
        return self.cfg.stages[self.stage]

    def observe(self, step: int, lengths: Sequence[int]) -> str | None:
        """Add a finished step's lengths; return the stage-change message when the indicator fires."""
        if self.stage + 1 >= len(self.cfg.stages):
            return None
        self.window = [*self.window, list(lengths)][-self.cfg.window:]
        pooled = [n for w in self.window for n in w]
        if len(self.window) < self.cfg.window or not pooled:
            return None
        q = quantile(pooled, self.cfg.quantile)
        if q < (1.0 - self.cfg.within) * self.cap:
            return None
        old = self.cap
        self.stage, self.window = self.stage + 1, []
        return (f"length growth: after step {step}, p{100 * self.cfg.quantile:g} response length {q} is within "
                f"{100 * self.cfg.within:g}% of the cap {old} over {self.cfg.window} steps; cap {old} -> {self.cap}")

    def metrics(self) -> dict[str, float]:
        return {"rollout/length_stage": float(self.stage), "rollout/length_cap": float(self.cap)}

    def state_dict(self) -> dict:
        return {"stage": self.stage, "window": [list(w) for w in self.window]}

    def load_state_dict(self, state: dict) -> None:
        self.stage, self.window = int(state["stage"]), [list(w) for w in state["window"]]
