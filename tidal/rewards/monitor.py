"""Per-step reward metrics: each component's mean, spread and correlation with response length.

MiniMax-M1 (arXiv 2506.13585, sec. 4.2) watches generative rewards for length bias: a judge that
prefers longer answers teaches the policy to ramble instead of to be right. The Pearson correlation
of every reward component with response length, logged each step (``reward/<name>/length_corr``),
makes that drift visible. A correlation is left out when either side is constant (undefined). The
spread (``reward/std``, ``reward/<name>/std``: population standard deviation over the step's samples)
says whether a component still separates samples: a length penalty every sample pays alike has none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two equal-length sequences; None when either is constant."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def std(xs: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def reward_metrics(
    rewards: Sequence[float], details: Sequence[Mapping[str, Any]], lengths: Sequence[int]
) -> dict[str, float]:
    """``reward/std``, ``reward/length_corr`` and, for every name in the samples' ``details["components"]``,
    ``reward/<name>/mean``, ``reward/<name>/std`` and ``reward/<name>/length_corr`` (over the samples that
    have it)."""
    out: dict[str, float] = {"reward/std": std(rewards)} if rewards else {}
    corr = pearson(rewards, [float(n) for n in lengths])
    if corr is not None:
        out["reward/length_corr"] = corr
    by_name: dict[str, tuple[list[float], list[float]]] = {}
    for d, n in zip(details, lengths):
        for name, score in (d.get("components") or {}).items():
            scores, lens = by_name.setdefault(name, ([], []))
            scores.append(float(score))
            lens.append(float(n))
    for name, (scores, lens) in sorted(by_name.items()):
        out[f"reward/{name}/mean"] = sum(scores) / len(scores)
        out[f"reward/{name}/std"] = std(scores)
        corr = pearson(scores, lens)
        if corr is not None:
            out[f"reward/{name}/length_corr"] = corr
    return out


@dataclass
class LengthBiasConfig:
    """``reward.length_bias``: act when a reward component's length correlation crosses a threshold.

    MiniMax-M1 (arXiv 2506.13585, sec. 4.2) monitors its generative reward model for length bias during
    RL and recalibrates it when the policy starts to win by length rather than by quality. tidal cannot
    retrain a judge mid-run, but it can act on the signal: ``warn`` (one line on stderr), ``lower_weight``
    (multiply the component's weight in the composed reward by ``factor``) or ``stop`` the run."""

    component: str | None = None
    """The watched component: its ``reward/<name>/length_corr`` is checked every step (e.g. ``judge``);
    None: off."""
    threshold: float = 0.3
    """Fire when the correlation is above this (a positive correlation is a preference for longer
    responses); our default, the paper gives no number."""
    patience: int = 1
    """Consecutive steps above ``threshold`` before firing (the count restarts after each firing)."""
    action: Literal["warn", "lower_weight", "stop"] = "warn"
    """What happens when it fires."""
    factor: float = 0.5
    """``lower_weight``: the component's weight is multiplied by this each time it fires."""


class LengthBiasHook:
    """Counts consecutive steps over the threshold; ``check`` returns a message when the hook fires."""

    def __init__(self, cfg: LengthBiasConfig):
        self.cfg = cfg
        self.streak = 0
        self.fired = 0

    @property
    def key(self) -> str:
        return f"reward/{self.cfg.component}/length_corr"

    def check(self, step: int, metrics: Mapping[str, float]) -> str | None:
        corr = metrics.get(self.key)
        if corr is None or corr <= self.cfg.threshold:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.cfg.patience:
            return None
        self.streak, self.fired = 0, self.fired + 1
        return (f"length bias: step {step}: {self.key} = {corr:.3f} > {self.cfg.threshold} for "
                f"{self.cfg.patience} step(s); action {self.cfg.action}")

    def state_dict(self) -> dict:
        return {"streak": self.streak, "fired": self.fired}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.fired = int(state["streak"]), int(state["fired"])
