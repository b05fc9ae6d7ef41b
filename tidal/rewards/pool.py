"""Reward worker pool: verifiers run in their own processes, with a per-item timeout.

Verifiers are CPU-bound and sometimes hang or raise on adversarial model output (math-verify uses
``signal.alarm`` and must run in a main thread; code runs untrusted programs). So they never run on
the trainer's thread: the pool scores batches in worker processes (AReaL's AsyncRewardWrapper idea).
An item that raises gets reward 0 with ``details["error"]``; an item that exceeds the timeout gets
reward 0 with ``details["error"] = "timeout"``, its worker is killed and the pool restarted, and the
other items are re-submitted, so one bad sample never stalls or kills a run. Both are counted.

Workers belong to the process that started them: they ignore SIGINT (a terminal's Ctrl-C reaches the
whole process group; the parent handles it and closes the pool, instead of every worker printing a
KeyboardInterrupt traceback), and they exit within a second of the parent's death, even by
``kill -9`` (otherwise each idled forever, and kept the forkserver and resource tracker alive too).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.rewards.monitor import LengthBiasConfig
from tidal.types import Prompt


@dataclass
class RewardConfig:
    """Which verifier scores responses and how it runs."""

    name: str = "exact_match"
    """Registered reward (``tidal.rewards.REWARDS``)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The reward's parameters (e.g. ``{mode: all_pass}`` for ``code``); ``--set reward.params.mode=...``."""
    num_workers: int = 1
    """Worker processes. 0 scores inline on the caller's thread (tests, trivially cheap rewards)."""
    timeout_s: float = 10.0
    """Per-response limit; a response that takes longer scores 0 and is counted as a timeout."""
    length_bias: LengthBiasConfig = field(default_factory=LengthBiasConfig)
    """The GenRM recalibration hook: act when a component's length correlation crosses a threshold
    (``rewards/monitor.py``, docs/curriculum.md)."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:  # no procfs (macOS): os.kill is all we know
        return True


def _watch_parent(pid: int, every_s: float = 1.0) -> None:
    while _alive(pid):
        time.sleep(every_s)
    os._exit(0)


def _init_worker(parent_pid: int) -> None:
    """Runs first in each worker (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="tidal-parent-watch", daemon=True).start()


def _warm_up(fn: Callable) -> None:
    """Runs in each worker once: unpickling ``fn`` imports its module; a reward with ``warm_up()`` (a model
    to load) does it here, before any deadline counts."""
    if hasattr(fn, "warm_up"):
        fn.warm_up()


def _score_one(fn: Callable, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
    try:
        reward, details = fn(response, prompt)
        return float(reward), dict(details)
    except Exception as e:  # a verifier bug or hostile input must not kill the run
        return 0.0, {"error": f"{type(e).__name__}: {e}"}


def _score_many(fn: Callable, items: list[tuple[str, Prompt]]) -> tuple[list[tuple[float, dict[str, Any]]], float]:
    """A chunk of items in one task (one round trip, one unpickling of ``fn``), and its duration."""
    start = time.perf_counter()
    if hasattr(fn, "score_batch"):  # a model-based reward: one batched forward for the chunk
        try:
            out = [(float(r), dict(d)) for r, d in fn.score_batch(items)]
        except Exception as e:
            out = [(0.0, {"error": f"{type(e).__name__}: {e}"})] * len(items)
        return out, time.perf_counter() - start
    return [_score_one(fn, r, p) for r, p in items], time.perf_counter() - start


class RewardPool:
    """Scores (response, prompt) pairs with ``fn`` in worker processes; see the module docstring."""

    def __init__(self, fn: Callable, cfg: RewardConfig):
        if not (isinstance(cfg.num_workers, int) and cfg.num_workers >= 0 and cfg.timeout_s > 0):
            raise ConfigError(f"reward.num_workers must be >= 0 and reward.timeout_s > 0, got {cfg.num_workers} "
                              f"and {cfg.timeout_s}")
        self.fn = fn
        self.cfg = cfg
        self.num_timeouts = 0
        self.num_errors = 0
        self._executor: ProcessPoolExecutor | None = None
        self._item_s = 0.0  # running mean of one item's scoring time (sizes the chunks)

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # forkserver: forking a process that runs torch threads is unsafe; spawn is slower to start.
            self._executor = ProcessPoolExecutor(self.cfg.num_workers, mp_context=mp.get_context("forkserver"),
                                                 initializer=_init_worker, initargs=(os.getpid(),))
            # Start every worker and import the verifier before any deadline starts counting, so
            # start-up time is never mistaken for a hanging verifier.
            try:
                for fut in [self._executor.submit(_warm_up, self.fn) for _ in range(self.cfg.num_workers)]:
                    fut.result()
            except BrokenProcessPool as e:
                self._executor = None
                raise RuntimeError(
                    "reward worker processes died while starting. If tidal runs from your own script, put "
                    "the call under `if __name__ == \"__main__\":` (workers re-import the main module), or "
                    "set reward.num_workers=0 to score inline") from e
        return self._executor

    def _restart(self) -> None:
        if self._executor is not None:
            for proc in list(getattr(self._executor, "_processes", {}).values()):
                proc.kill()
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None

    def score(self, items: Sequence[tuple[str, Prompt]]) -> list[tuple[float, dict[str, Any]]]:
        """One (reward, details) per item, in order.

        Items go to the workers in chunks sized so a chunk takes about a quarter of ``timeout_s``
        (one round trip per chunk instead of per item: cheap verifiers like math spend most of their
        time in IPC otherwise). A chunk that misses the per-item deadline, or whose worker dies, is
        re-scored item by item, so each item still gets exactly the per-item limit."""
        results: list[tuple[float, dict[str, Any]] | None] = [None] * len(items)
        if self.cfg.num_workers == 0:
            return [self._count(result) for result in _score_many(self.fn, list(items))[0]]
        size = self._chunk_size(len(items))
        chunks = [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]
        pool = self._pool()
        futures = [(chunk, pool.submit(_score_many, self.fn, [items[i] for i in chunk])) for chunk in chunks]
        singly: list[int] = []
        for chunk, fut in futures:
            if singly and self._executor is None:  # the pool was restarted: its futures are gone
                singly.extend(chunk)
                continue
            try:
                out, seconds = fut.result(timeout=self.cfg.timeout_s)
            except Exception:  # too slow as a chunk, or the worker died: find the culprit item by item
                self._restart()
                singly.extend(chunk)
                continue
            self._item_s = 0.8 * self._item_s + 0.2 * seconds / len(chunk) if self._item_s else seconds / len(chunk)
            for i, result in zip(chunk, out):
                results[i] = self._count(result)
        if singly:
            self._score_singly(items, singly, results)
        return results  # type: ignore[return-value]

    def _chunk_size(self, num_items: int) -> int:
        per_worker = -(-num_items // self.cfg.num_workers)  # keep every worker busy
        if self._item_s <= 0:
            return max(1, min(4, per_worker))
        budget = int(0.25 * self.cfg.timeout_s / self._item_s)
        return max(1, min(32, budget, per_worker))

    def _score_singly(self, items, todo: list[int], results: list) -> None:
        """One task per item, each with its own deadline: a hang or a crash costs only that item."""
        while todo:
            pool = self._pool()
            futures: dict[int, Future] = {i: pool.submit(_score_one, self.fn, *items[i]) for i in todo}
            todo = []
            restarted = False
            for i, fut in futures.items():
                if restarted:
                    todo.append(i)  # its worker pool was killed: score it again in the new pool
                    continue
                try:
                    results[i] = self._count(fut.result(timeout=self.cfg.timeout_s))
                except FutureTimeout:
                    self.num_timeouts += 1
                    results[i] = (0.0, {"error": "timeout"})
                    self._restart()
                    restarted = True
                except Exception as e:  # worker died (e.g. killed by the OS): count it, score 0
                    self.num_errors += 1
                    results[i] = (0.0, {"error": f"worker failed: {type(e).__name__}: {e}"})
                    self._restart()
                    restarted = True

    def _count(self, result: tuple[float, dict[str, Any]]) -> tuple[float, dict[str, Any]]:
        if "error" in result[1]:
            self.num_errors += 1
        return result

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
