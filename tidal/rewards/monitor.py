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
from typing import Any


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
