"""Data-mixture math shared by ``tidal curate mixture`` and the ``aioli`` task-mixture schedule.

Pure functions on plain lists (and, for merging, state dicts of tensors); no training here.

**Mixtures** are points of the probability simplex over k domains. ``simplex_lattice(k, n)`` lists
every mixture whose proportions are multiples of 1/n (C(n+k-1, k-1) points): the grid of the ground
truth and the candidate set the merge proxy scores.

**Merging as a proxy for a mixture** (Tao et al., "Merge to Mix", arXiv 2505.16066; MergeMix,
arXiv 2601.17858): experts fine-tuned from one shared base, one per domain, are combined as
``base + sum_k a_k (expert_k - base)``; the merged model's held-out loss estimates the loss of
training on mixture ``a``, with no further training. With ``sum a = 1`` this is ``sum_k a_k expert_k``;
the task-vector form is kept because it is what the papers write and it is exact for any ``a``.

**Aioli** (Chen et al., "Aioli: A unified optimization framework for language model data mixing",
arXiv 2411.05735, Algorithms 1-2, and the authors' ``trainer/aioli_trainer.py``). The linear mixing
law says the loss drop on evaluation group i after a short stretch of training on mixture p is
``sum_j A[i][j] p_j``. Each round, LearnParams trains ``lp_steps`` steps on each *smoothed one-hot*
mixture (``one_hot_factor`` f on domain j, ``(1 - f)/(k - 1)`` on each other), ``lp_rounds`` sweeps in
shuffled order, and records how much each evaluation loss fell; averaging over sweeps and undoing the
smoothing (solve ``W a_i = drop_i``, W's row j being sweep j's mixture) estimates A. A is normalised
(shifted so its smallest entry is 0 when one is negative, then divided by its sum), and the proportions
take one exponentiated-gradient step ``p <- p * exp(eta * sum_i A[i][:])`` (renormalised). The authors'
recommended values: ``lp_rounds`` 4, ``lp_steps`` 4, ``eta`` 0.2, ``one_hot_factor`` 0.625 (README of
HazyResearch/aioli, ``scripts/*/aioli/run.sh``), with the EMA of A left off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def simplex_lattice(k: int, n: int) -> list[tuple[float, ...]]:
    """Every mixture of ``k`` domains whose proportions are multiples of ``1/n``, in lexicographic order."""
    if k < 1 or n < 1:
        raise ValueError(f"simplex_lattice needs k >= 1 and n >= 1, got k={k}, n={n}")

    def parts(total: int, slots: int):
        if slots == 1:
            yield (total,)
            return
        for first in range(total, -1, -1):
            for rest in parts(total - first, slots - 1):
                yield (first, *rest)

    return [tuple(c / n for c in combo) for combo in parts(n, k)]


def merge_weights(base: Mapping, experts: Sequence[Mapping], mix: Sequence[float]) -> dict:
    """``base + sum_k mix_k (experts_k - base)`` for every floating tensor (others copied from base)."""
    if len(experts) != len(mix):
        raise ValueError(f"{len(experts)} experts but {len(mix)} mixture proportions")
    out = {}
    for name, b in base.items():
        if not b.is_floating_point():
            out[name] = b.clone()
            continue
        merged = b.clone()
        for a, expert in zip(mix, experts):
            merged += a * (expert[name] - b)
        out[name] = merged
    return out


def smoothed_one_hot(k: int, j: int, factor: float) -> list[float]:
    """Aioli's LearnParams mixture for domain ``j``: ``factor`` on j, the rest spread evenly."""
    if k == 1:
        return [1.0]
    return [factor if i == j else (1.0 - factor) / (k - 1) for i in range(k)]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (k is a handful of domains)."""
    n = len(rhs)
    a = [list(row) + [r] for row, r in zip(matrix, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("Aioli: the smoothed one-hot mixtures are singular (one_hot_factor = 1/k?)")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def aioli_interactions(drops: Sequence[Sequence[float]], factor: float) -> list[list[float]]:
    """A from LearnParams: ``drops[i][j]`` is the mean fall of evaluation loss i over a sweep on domain
    j's smoothed one-hot mixture; each row is un-smoothed by solving ``W a_i = drops_i`` (``factor`` 1:
    no smoothing, A = drops)."""
    k = len(drops[0])
    if factor == 1.0 or k == 1:
        return [list(map(float, row)) for row in drops]
    w = [smoothed_one_hot(k, j, factor) for j in range(k)]
    return [_solve(w, list(map(float, row))) for row in drops]


def aioli_normalize(a: Sequence[Sequence[float]]) -> list[list[float]]:
    """Shift A so its smallest entry is 0 (only when one is negative), then divide by its sum."""
    low = min(min(row) for row in a)
    shifted = [[x - low if low < 0 else x for x in row] for row in a]
    total = sum(map(sum, shifted))
    if total <= 0:  # every entry equal after the shift: no domain helps more than another
        return [[0.0] * len(row) for row in shifted]
    return [[x / total for x in row] for row in shifted]


def aioli_step(p: Sequence[float], a: Sequence[Sequence[float]], eta: float) -> list[float]:
    """One exponentiated-gradient step on the proportions: ``p_j * exp(eta * sum_i A[i][j])``, renormalised."""
    grad = [sum(row[j] for row in a) for j in range(len(p))]
    raw = [pj * math.exp(eta * g) for pj, g in zip(p, grad)]
    total = sum(raw)
    return [r / total for r in raw]
