"""Online difficulty weighting: sample the prompts whose groups are likely to carry a gradient.

Magistral (arXiv 2506.10910, sec. 4) filters its problems *offline* by pass rate, keeping the
"goldilocks" ones a policy solves sometimes but not always, because a GRPO group whose rewards are
all equal has zero advantage and teaches nothing. The same estimate can be had for free *online*:
every group the run scores is G samples of that prompt's pass rate. So each prompt of a finite pool
keeps a decayed count of its solved samples ``s`` and samples ``n`` (updated from groups already
scored; no extra generation), and the next prompt is drawn with weight

    w(p) = max(floor, q(p) / q(1/2)),    q(p) = 1 - p^G - (1 - p)^G,    p = s / n

where q(p) is the probability that a group of G samples is *not* all-equal (informative), largest
at p = 1/2 (normalised to 1 there). A prompt never seen has ``p = prior`` (default 1/2: explore it
first). ``floor`` keeps prompts that look solved or hopeless in play, so they are revisited as the
policy changes; ``decay`` weights recent groups more (on each new group, the old counts are
multiplied by it), so a prompt that became solvable is noticed.

A draw for group index i uses the uniform ``hash(seed, key, i)``, so given the same counts the same
prompt is drawn; the counts are the sampler's whole state (``state_dict``), checkpointed with the
run, so a resumed run draws exactly what the uninterrupted one would.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass

from tidal.utils.seeding import stable_hash


@dataclass
class OnlineDifficultyConfig:
    """Online difficulty weighting of the training prompts (``curriculum.difficulty``)."""

    enabled: bool = False
    """Draw training prompts by their estimated informativeness instead of in stream order."""
    floor: float = 0.05
    """The least weight of a prompt (relative to an ideal p = 1/2 prompt's 1): solved and unsolved
    prompts are still drawn, at 1/20 the rate, so they are revisited (our default; Magistral filters
    them out entirely, offline)."""
    decay: float = 0.5
    """On each new group of a prompt its earlier counts are multiplied by this (1: plain counts;
    0.5: the newest group weighs as much as all earlier ones together)."""
    prior: float = 0.5
    """Pass rate assumed for a prompt never scored (0.5: the most informative, so new prompts are tried
    first; lower it to favour prompts already known to be informative)."""
    pass_threshold: float = 1.0
    """A sample counts as solved when its reward is at least this (1.0, as ``eval/accuracy``)."""


def informative_probability(p: float, group_size: int) -> float:
    """P(a group of ``group_size`` samples with pass rate ``p`` has unequal rewards) = 1 - p^G - (1-p)^G."""
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def prompt_weight(solved: float, seen: float, group_size: int, cfg: OnlineDifficultyConfig) -> float:
    """The sampling weight of a prompt with decayed counts ``solved`` of ``seen`` (module docstring)."""
    p = cfg.prior if seen <= 0 else solved / seen
    return max(cfg.floor, informative_probability(p, group_size) / informative_probability(0.5, group_size))


class DifficultySampler:
    """Weighted draws over a pool of ``pool_size`` prompts (positions 0..N-1), thread-safe: the generator
    draws while the trainer observes."""

    def __init__(self, pool_size: int, group_size: int, cfg: OnlineDifficultyConfig, seed: int, key: str = ""):
        assert pool_size > 0, "an empty prompt pool"
        self.cfg, self.group_size, self.seed, self.key = cfg, group_size, seed, key
        self.solved = [0.0] * pool_size
        self.seen = [0.0] * pool_size
        w0 = prompt_weight(0.0, 0.0, group_size, cfg)
        self._weights = [w0] * pool_size
        self._cdf: list[float] | None = None
        self._lock = threading.Lock()

    @property
    def pool_size(self) -> int:
        return len(self.solved)

    def choose(self, index: int) -> int:
        """The pool position drawn for group ``index``."""
        with self._lock:
            if self._cdf is None:
                self._cdf = list(itertools.accumulate(self._weights))
            u = stable_hash(self.seed, "difficulty", self.key, index) / 2**63 * self._cdf[-1]
            return min(bisect.bisect_right(self._cdf, u), self.pool_size - 1)

    def observe(self, position: int, num_solved: int, num_samples: int) -> None:
        """Fold one scored group of the prompt at ``position`` into its counts."""
        if num_samples <= 0:
            return
        with self._lock:
            d = self.cfg.decay
            self.solved[position] = d * self.solved[position] + num_solved
            self.seen[position] = d * self.seen[position] + num_samples
            self._weights[position] = prompt_weight(self.solved[position], self.seen[position], self.group_size,
                                                    self.cfg)
            self._cdf = None

    def metrics(self) -> dict[str, float]:
        """Seen fraction of the pool, mean estimated pass rate over seen prompts, and the share of seen
        prompts at the floor (looking solved or hopeless)."""
        with self._lock:
            seen = [i for i, n in enumerate(self.seen) if n > 0]
            rates = [self.solved[i] / self.seen[i] for i in seen]
            floor = sum(self._weights[i] <= self.cfg.floor for i in seen)
        return {"seen_frac": len(seen) / self.pool_size,
                "pass_rate_mean": sum(rates) / len(rates) if rates else 0.0,
                "floor_frac": floor / len(seen) if seen else 0.0}

    def state_dict(self) -> dict:
        """The counts of the prompts seen so far: ``{"positions", "solved", "seen"}`` (plain lists)."""
        with self._lock:
            positions = [i for i, n in enumerate(self.seen) if n > 0]
            return {"pool_size": self.pool_size, "positions": positions,
                    "solved": [self.solved[i] for i in positions], "seen": [self.seen[i] for i in positions]}

    def load_state_dict(self, state: dict) -> None:
        if state["pool_size"] != self.pool_size:
            raise ValueError(f"online difficulty state for a pool of {state['pool_size']} prompts, but the task "
                             f"has {self.pool_size} (was the task changed before --resume?)")
        with self._lock:
            for i, s, n in zip(state["positions"], state["solved"], state["seen"]):
                self.solved[i], self.seen[i] = s, n
                self._weights[i] = prompt_weight(s, n, self.group_size, self.cfg)
            self._cdf = None
