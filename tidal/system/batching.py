"""Which scored groups make up a training batch: DAPO's dynamic sampling and the staleness guard.

Groups are consumed from the prompt stream in index order through a cursor (the run's data
position, saved in checkpoints). Without dynamic sampling a step takes the next P groups. With it
(DAPO, arXiv 2503.14476, sec. 3.2), a group whose samples all got the same reward carries no
advantage, so it is dropped and the step keeps drawing until it holds P informative groups, or until
it has drawn ``max_draws`` x P groups (verl's ``max_num_gen_batches`` plays the same role), in which
case it trains on what it has. Every drop is counted.

Staleness accounting with drops: the admission rule (``staleness.py``) counts groups that will be
trained. A dropped group gives its slot back (``StalenessManager.release``) and a short batch
charges its missing groups (``charge``), so later groups still land within eta versions. Only a
short batch can make an already-admitted group too stale; such a group is dropped here (counted as
``async/dropped_stale``) rather than trained outside the bound, and its slot is given back at once
(``on_stale``): the trainer may be waiting for a group that only that slot lets the generator start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidal.algo.filters import informative as rewards_informative
from tidal.types import Group


def informative(group: Group) -> bool:
    """A group whose rewards are not all equal (a single-sample group never is)."""
    return rewards_informative(group.rewards)


def length_budget(schedule: Sequence[Sequence[int]], step: int, default: int) -> int:
    """Staged length scaling: the ``max_new_tokens`` of the last ``[from_step, tokens]`` pair with
    ``from_step <= step`` (pairs sorted by step), else ``default``."""
    budget = default
    for from_step, tokens in sorted(schedule):
        if from_step <= step:
            budget = tokens
    return budget


def too_stale(group: Group, step: int, max_staleness: int) -> bool:
    """More than ``max_staleness`` versions behind ``step``, counted from the group's oldest sampled
    token. A group with no samples left (every episode an infrastructure failure) has no age."""
    return bool(group.rewards) and step - group.oldest_version > max_staleness


@dataclass
class Collected:
    groups: list[Group]
    cursor: int
    """The stream position after the last group drawn."""
    metrics: dict[str, float]

    @property
    def shortfall(self) -> int:
        return int(self.metrics["algo/shortfall_groups"])


def collect_batch(
    take: Callable[[int, int], Group],
    cursor: int,
    step: int,
    groups_per_step: int,
    dynamic: bool,
    max_draws: int,
    max_staleness: int | None,
    on_stale: Callable[[Group], None] = lambda group: None,
) -> Collected:
    """Draw groups ``take(index, still_needed)`` from ``cursor`` on until the batch is full or the
    draw limit is reached. ``max_staleness`` None skips the staleness guard (sync mode)."""
    limit = groups_per_step * (max_draws if dynamic else 1)
    groups: list[Group] = []
    drawn = dropped_flat = dropped_stale = 0
    while len(groups) < groups_per_step and drawn < limit:
        need = min(groups_per_step - len(groups), limit - drawn)
        group = take(cursor, need)
        cursor += 1
        drawn += 1
        if dynamic and not informative(group):
            dropped_flat += 1
        elif max_staleness is not None and too_stale(group, step, max_staleness):
            dropped_stale += 1
            on_stale(group)
        else:
            groups.append(group)
    metrics = {
        "algo/drawn_groups": float(drawn),
        "algo/dropped_groups": float(dropped_flat),
        "algo/shortfall_groups": float(groups_per_step - len(groups)),
    }
    if max_staleness is not None:
        metrics["async/dropped_stale"] = float(dropped_stale)
    return Collected(groups, cursor, metrics)
