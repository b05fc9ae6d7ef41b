"""The Ray backend's reward side: ``RewardPool``'s contract over Ray actors, replacing dead ones.

Each reward worker is a Ray actor holding the reward function (placed with
``system.reward_worker_cpus``). ``score`` splits the items into chunks over the workers (one round
trip per chunk) and waits for each with the per-item deadline ``reward.timeout_s``, as
``rewards/pool.py`` does with processes:

- a chunk whose worker dies (``RayActorError``: killed, out of memory, a node lost) or misses the
  deadline gets its worker replaced by a fresh actor and its items re-scored one by one;
- one by one, an item that misses its deadline scores 0 with ``details["error"] = "timeout"`` and
  an item whose worker dies is tried once more on a fresh worker, then scores 0 with the error.

Both outcomes are counted (``num_timeouts``, ``num_errors``; replacements in ``num_replaced``), so
a hostile sample or a lost worker costs a few items, never the run. This module does not import
torch: reward actors unpickle their class from here and should start fast.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tidal.rewards.pool import RewardConfig, _score_one
from tidal.types import Prompt

log = logging.getLogger(__name__)

SINGLE_ATTEMPTS = 2
"""Tries an item gets, one by one, before a dying worker scores it 0 (an item that crashes its
worker every time must not take the pool down with it)."""


class RewardWorker:
    """Runs inside a Ray actor: scores items with ``fn`` on the actor's main thread."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def ping(self) -> bool:
        return True

    def score(self, items: list[tuple[str, Prompt]]) -> tuple[list[tuple[float, dict[str, Any]]], float]:
        """The items' scores and how long they took (sizes the driver's chunks)."""
        start = time.perf_counter()
        return [_score_one(self.fn, r, p) for r, p in items], time.perf_counter() - start


class RayRewardPool:
    """Scores (response, prompt) pairs on ``num_workers`` Ray actors; see the module docstring."""

    def __init__(self, fn: Callable, cfg: RewardConfig, num_workers: int, num_cpus: float = 0.0,
                 start_timeout_s: float = 300.0):
        from tidal.system.ray_engine import actor_errors, require_ray

        assert num_workers > 0, "RayRewardPool needs at least one worker (reward.num_workers=0 scores inline)"
        self._ray = require_ray()
        self._errors = actor_errors()
        self.cfg = cfg
        self.num_timeouts = 0
        self.num_errors = 0
        self.num_replaced = 0
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()  # the scorer and the evaluator may both find a worker dead
        self._fn_ref = self._ray.put(fn)
        self._actor_cls = self._ray.remote(RewardWorker).options(num_cpus=num_cpus, max_restarts=0)
        self.workers = [self._actor_cls.remote(self._fn_ref) for _ in range(num_workers)]
        self._wait_ready(self.workers)
        self._item_s = 0.0  # running mean of one item's scoring time (sizes the chunks)

    def _wait_ready(self, workers: list) -> None:
        # Start every worker and import the verifier before any deadline starts counting.
        refs = [w.ping.remote() for w in workers]
        _, pending = self._ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        if pending:
            raise RuntimeError(f"{len(pending)} reward workers did not start within {self.start_timeout_s:.0f}s "
                               f"(cluster: {self._ray.cluster_resources()}); lower system.reward_worker_cpus")
        self._ray.get(refs)

    def _replace(self, k: int, actor) -> None:
        """Replace worker ``k`` if it is still ``actor`` (several failed calls may name the same one)."""
        with self._lock:
            if self.workers[k] is not actor:
                return
            self._ray.kill(actor)
            fresh = self._actor_cls.remote(self._fn_ref)
            self._wait_ready([fresh])
            self.workers[k] = fresh
            self.num_replaced += 1
        log.warning("reward worker %d replaced (%d so far)", k, self.num_replaced)

    def score(self, items: Sequence[tuple[str, Prompt]]) -> list[tuple[float, dict[str, Any]]]:
        """One (reward, details) per item, in order."""
        results: list[tuple[float, dict[str, Any]] | None] = [None] * len(items)
        if not items:
            return []
        n = len(self.workers)
        size = self._chunk_size(len(items))
        chunks = [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]
        calls = []
        for j, chunk in enumerate(chunks):
            actor = self.workers[j % n]
            calls.append((chunk, j % n, actor, actor.score.remote([items[i] for i in chunk])))
        singly: list[int] = []
        for chunk, k, actor, ref in calls:
            try:
                out, seconds = self._ray.get(ref, timeout=self.cfg.timeout_s)
            except (*self._errors, self._ray.exceptions.GetTimeoutError):  # died, or too slow as a chunk
                self._replace(k, actor)
                singly.extend(chunk)
                continue
            item_s = seconds / len(chunk)
            self._item_s = 0.8 * self._item_s + 0.2 * item_s if self._item_s else item_s
            for i, result in zip(chunk, out):
                results[i] = self._count(result)
        if singly:
            self._score_singly(items, singly, results)
        return results  # type: ignore[return-value]

    def _chunk_size(self, num_items: int) -> int:
        """About a quarter of the deadline's worth of items per chunk (as ``RewardPool``), at most 32,
        and no more than keeps every worker busy."""
        per_worker = -(-num_items // len(self.workers))
        if self._item_s <= 0:
            return max(1, min(4, per_worker))
        return max(1, min(32, int(0.25 * self.cfg.timeout_s / self._item_s), per_worker))

    def _score_singly(self, items, todo: list[int], results: list) -> None:
        """One call per item, each with its own deadline, a wave of one item per worker at a time."""
        attempts = dict.fromkeys(todo, 0)
        todo = list(todo)
        while todo:
            wave, todo = todo[: len(self.workers)], todo[len(self.workers):]
            calls = [(i, k, self.workers[k], self.workers[k].score.remote([items[i]])) for k, i in enumerate(wave)]
            for i, k, actor, ref in calls:
                attempts[i] += 1
                try:
                    results[i] = self._count(self._ray.get(ref, timeout=self.cfg.timeout_s)[0][0])
                except self._ray.exceptions.GetTimeoutError:
                    self.num_timeouts += 1
                    results[i] = (0.0, {"error": "timeout"})
                    self._replace(k, actor)
                except self._errors as e:
                    self._replace(k, actor)
                    if attempts[i] < SINGLE_ATTEMPTS:
                        todo.append(i)
                    else:
                        self.num_errors += 1
                        results[i] = (0.0, {"error": f"reward worker died: {type(e).__name__}"})

    def _count(self, result: tuple[float, dict[str, Any]]) -> tuple[float, dict[str, Any]]:
        if "error" in result[1]:
            self.num_errors += 1
        return result

    def close(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []
