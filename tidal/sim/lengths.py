"""Response-length distributions for the simulator, and the stream of lengths a run draws from.

Why lengths matter: a synchronous step waits for the longest response in its batch, so the gap
between the mean and the maximum of the batch is the time sync loses (AReaL, arXiv 2505.24298,
sec. 1). The distributions here are the usual shapes of that gap:

- ``constant:L``            every response has L tokens (no stragglers: async gains nothing from them)
- ``bimodal:S,L,P``         L tokens with probability P, else S (the closed-form test case)
- ``cycle:a,b,...``         deterministic: the i-th response of the stream has ``values[i % n]`` tokens
- ``one_over_n:M[,OFF]``    the ``repeat`` task (``tasks/arithmetic.py``): n in 1..M with weight
                            max(1, round(M / n)), response n + OFF tokens (OFF=1: the EOS)
- ``lognormal:MEAN,SIGMA,MAX``  long-CoT style: a lognormal with that mean, clipped to [1, MAX]
                            (clipped samples are the truncated ones: they take MAX tokens)
- ``empirical:PATH``        lengths read from a file (see ``read_lengths``)
- ``groups:PATH``           whole groups drawn from a file (``{"groups": [{"lengths": [...],
                            "informative": bool}, ...]}``, as the CPU calibration writes): keeps the
                            lengths within a group together with whether its rewards differ

A run draws groups through a ``GroupStream``: the k-th group of the stream has the same lengths in
every mode (common random numbers), so sync/async ratios compare the same workload.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Choice:
    """A discrete distribution: ``values[i]`` with probability proportional to ``weights[i]``."""

    values: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        assert len(self.values) == len(self.weights) > 0, "values and weights must be non-empty and aligned"
        assert min(self.values) >= 1 and min(self.weights) >= 0 and sum(self.weights) > 0, (
            f"lengths {self.values} must be >= 1, with weights {self.weights} >= 0 and not all 0")

    @property
    def mean(self) -> float:
        return sum(v * w for v, w in zip(self.values, self.weights)) / sum(self.weights)

    @property
    def max(self) -> int:
        return max(v for v, w in zip(self.values, self.weights) if w > 0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = np.asarray(self.weights, dtype=float)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, p=p / p.sum())


@dataclass(frozen=True)
class LogNormal:
    """Lognormal with the given mean (of the unclipped law) and log-space sigma, clipped to [1, max_len]."""

    mean_len: float
    sigma: float
    max_len: int

    @property
    def mean(self) -> float:
        """Mean of the clipped law, estimated from 200,000 seeded draws (exact enough for reports)."""
        x = self.sample(np.random.default_rng(12345), 200_000)
        return float(x.mean())

    @property
    def max(self) -> int:
        return self.max_len

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean_len) - self.sigma**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
        x = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return np.clip(x, 1, self.max_len).astype(np.int64)


@dataclass(frozen=True)
class Cycle:
    """Deterministic: response i of the stream has ``values[i % len(values)]`` tokens."""

    values: tuple[int, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def max(self) -> int:
        return max(self.values)


LengthDist = Choice | LogNormal | Cycle


def constant(length: int) -> Choice:
    return Choice((length,), (1.0,))


def bimodal(short: int, long: int, p_long: float) -> Choice:
    return Choice((short, long), (1.0 - p_long, p_long))


def one_over_n(max_n: int, offset: int = 1) -> Choice:
    """The ``repeat`` task's law: n copies of a letter, n drawn with weight max(1, round(max_n / n))."""
    ns = range(1, max_n + 1)
    return Choice(tuple(n + offset for n in ns), tuple(float(max(1, round(max_n / n))) for n in ns))


def read_lengths(path: str | Path) -> list[int]:
    """Response lengths from a file: a JSON list, a JSON object with ``lengths`` (a list) or ``values`` +
    ``weights`` (a histogram, expanded), a JSONL file whose rows carry ``num_tokens``, ``length``,
    ``response_len`` or ``token_ids`` (a trajectory dump), or plain text with one number per line."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        return [int(x) for x in data]
    if isinstance(data, dict) and "lengths" in data:
        return [int(x) for x in data["lengths"]]
    if isinstance(data, dict) and "values" in data:
        return [int(v) for v, w in zip(data["values"], data["weights"]) for _ in range(int(w))]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line) if line.startswith("{") else int(float(line))
        except ValueError as e:
            raise ValueError(f"{path}: line {n}: not a length or a JSON object ({e})") from None
        if not isinstance(row, dict):
            out.append(row)
            continue
        key = next((k for k in ("num_tokens", "length", "response_len") if k in row), None)
        if key is not None:
            out.append(int(row[key]))
        elif "token_ids" in row:
            out.append(len(row["token_ids"]))
        else:
            raise ValueError(f"{path}: line {n} has none of num_tokens, length, response_len, token_ids")
    return out


def empirical(lengths: list[int]) -> Choice:
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    return Choice(tuple(int(v) for v in values), tuple(float(c) for c in counts))


def parse_lengths(spec: str) -> LengthDist:
    """``name:args`` (see the module docstring) to a distribution; a clear error for a bad spec."""
    name, _, args = spec.partition(":")
    nums = [a.strip() for a in args.split(",") if a.strip()]
    try:
        if name == "constant":
            return constant(int(nums[0]))
        if name == "bimodal":
            return bimodal(int(nums[0]), int(nums[1]), float(nums[2]))
        if name == "cycle":
            return Cycle(tuple(int(x) for x in nums))
        if name == "one_over_n":
            return one_over_n(int(nums[0]), int(nums[1]) if len(nums) > 1 else 1)
        if name == "lognormal":
            return LogNormal(float(nums[0]), float(nums[1]), int(nums[2]))
        if name == "empirical":
            return empirical(read_lengths(args))
    except (IndexError, ValueError) as e:
        raise ValueError(f"bad length spec {spec!r}: {e}") from None
    raise ValueError(f"unknown length distribution {name!r} in {spec!r}; "
                     "use constant, bimodal, cycle, one_over_n, lognormal or empirical")


class LengthStream:
    """Lengths of responses 0, 1, 2, ... of a run, drawn lazily in seeded chunks (reproducible, and
    independent of how many responses a mode ends up drawing)."""

    CHUNK = 4096

    def __init__(self, dist: LengthDist, seed: int = 0):
        self.dist = dist
        self.seed = seed
        self._chunks: dict[int, np.ndarray] = {}

    def __getitem__(self, index: int) -> int:
        if isinstance(self.dist, Cycle):
            return self.dist.values[index % len(self.dist.values)]
        chunk, offset = divmod(index, self.CHUNK)
        if chunk not in self._chunks:
            rng = np.random.default_rng([self.seed, chunk])
            self._chunks[chunk] = self.dist.sample(rng, self.CHUNK)
        return int(self._chunks[chunk][offset])


def read_groups(path: str | Path) -> list[tuple[list[int], bool]]:
    """``(lengths, informative)`` per group from a JSON file with a ``groups`` list (see above)."""
    data = json.loads(Path(path).read_text())
    groups = [(list(map(int, g["lengths"])), bool(g["informative"])) for g in data["groups"]]
    assert groups, f"{path}: no groups"
    return groups


class GroupStream:
    """Group i of a run: its response lengths and whether its rewards differ (informative).

    Lengths come from ``spec``; a group is uninformative with probability ``drop_prob``, decided per
    group by the seed, unless ``spec`` is ``groups:PATH`` (both then come from the recorded group)."""

    def __init__(self, spec: str, group_size: int, drop_prob: float = 0.0, seed: int = 0):
        self.group_size, self.drop_prob, self.seed = group_size, drop_prob, seed
        self.recorded = read_groups(spec.partition(":")[2]) if spec.startswith("groups:") else None
        if self.recorded is not None:
            sizes = {len(lengths) for lengths, _ in self.recorded}
            assert sizes == {group_size}, f"{spec}: groups of {sorted(sizes)} samples, but group_size={group_size}"
            self.dist = empirical([n for lengths, _ in self.recorded for n in lengths])
        else:
            self.dist = parse_lengths(spec)
            self.lengths = LengthStream(self.dist, seed)

    def __getitem__(self, index: int) -> tuple[list[int], bool]:
        rng = random.Random(f"{self.seed}-{index}")
        if self.recorded is not None:
            return self.recorded[rng.randrange(len(self.recorded))]
        g = self.group_size
        return [self.lengths[index * g + s] for s in range(g)], rng.random() >= self.drop_prob
