"""The curation pipeline: rows flow through a chain of blocks; each block keeps a row or drops it
with a reason, and counts both (datatrove's design: ``pipeline/base.py``, ``filters/base_filter.py``).

A block splits its work in two so the pipeline can use every core without giving up exactness:

- ``prepare(row)``: pure per-row work (a filter's whole decision, a MinHash signature, a hash). It
  runs in a process pool on chunks of rows, in parallel.
- ``decide(row, prepared) -> reason | None``: runs in the main process, in input order. A stateless
  filter just returns what ``prepare`` computed; a dedup block checks the signature against what it
  has kept so far. So the output is the same for any number of workers.

Filters never modify rows: what comes out is a subset of what went in, in input order. A mapper
(rephrasing) returns a new row from ``transform`` that names its source row.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from tidal.data.io import Row


class Block:
    """A keep-or-drop step. Subclasses set ``name`` and override ``prepare`` (pure, picklable) and,
    for stateful blocks, ``decide``."""

    name = "block"
    keep_all_examples = False
    """Report every dropped row, not only the first few (decontamination: say what was removed and why)."""
    detail: Any = None
    """Set by ``decide`` to explain its last drop (e.g. the evaluation item and the shared n-gram)."""
    row_number: int = 0
    """Set by the pipeline before ``decide``/``transform``: the row's 1-based line (JSONL) or row number
    in the input, so a mapper can name its source row the way the report does."""
    parallel = True
    """False: ``prepare_chunk`` runs in the main process (a block that batches its own work, such as
    generation with the rollout engine)."""

    def prepare(self, row: Row) -> Any:
        """Per-row work that needs no state; for a plain filter, the drop reason (None: keep)."""
        raise NotImplementedError

    def prepare_chunk(self, rows: list[Row]) -> list[Any]:
        return [self.prepare(row) for row in rows]

    def decide(self, row: Row, prepared: Any) -> str | None:
        """The drop reason for ``row`` (None: keep), given what ``prepare`` returned."""
        return prepared

    def transform(self, row: Row, prepared: Any) -> Row:
        """The row to pass on when kept: the row itself for filters; mappers (rephrasing) return a new one."""
        return row

    def summary(self) -> dict[str, Any]:
        """Extra numbers for the report (e.g. clusters found)."""
        return {}


class TextFilter(Block):
    """A stateless filter of one text field: rows without it are dropped as ``no_<key>``; subclasses
    implement ``check(text) -> reason | None``."""

    text_key = "text"

    def prepare(self, row: Row) -> str | None:
        text = row.get(self.text_key)
        return self.check(text) if isinstance(text, str) else f"no_{self.text_key}"

    def check(self, text: str) -> str | None:
        raise NotImplementedError


@dataclass
class BlockStats:
    name: str
    seen: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    examples: list[dict] = field(default_factory=list)
    """The first dropped rows' 1-based input line (or row) numbers and reasons (for the report)."""

    def as_dict(self, extra: dict) -> dict:
        return {"name": self.name, "seen": self.seen, "kept": self.kept, "dropped": dict(self.dropped),
                "seconds": round(self.seconds, 4), "rows_per_s": self.seen / self.seconds if self.seconds else None,
                **extra, "examples": self.examples}


_WORKER_BLOCKS: list[Block] = []


def _init_worker(blocks: list[Block]) -> None:
    global _WORKER_BLOCKS
    _WORKER_BLOCKS = blocks
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it ends the pool)


def _prepare_chunk(args: tuple[int, list[Row]]) -> list[Any]:
    index, rows = args
    block = _WORKER_BLOCKS[index]
    return [block.prepare(row) for row in rows]


class _ProcessPool:
    """Local worker processes; each gets the blocks once, at start."""

    def __init__(self, blocks: list[Block], workers: int):
        self.workers = workers
        # Forked workers inherit SIGINT ignored from the start (a Ctrl-C racing their initializer would
        # print a traceback per worker); the main process keeps its handler and ends the pool.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.pool = mp.get_context().Pool(workers, initializer=_init_worker, initargs=(blocks,))
        finally:
            if previous is not None:  # None: a handler not set from Python (nothing to restore)
                signal.signal(signal.SIGINT, previous)

    def map(self, index: int, parts: list[list[Row]]) -> list[list[Any]]:
        return self.pool.map(_prepare_chunk, [(index, part) for part in parts])

    def close(self) -> None:
        self.pool.terminate()


def _ray_prepare(blocks: list[Block | None], index: int, rows: list[Row]) -> list[Any]:
    return [blocks[index].prepare(row) for row in rows]


class _RayPool:
    """Ray tasks across a cluster (``ray start --head`` / ``--address``, or a local instance). The
    parallel blocks go to the object store once; blocks that run in the main process (they hold a
    model) are not shipped."""

    def __init__(self, blocks: list[Block], address: str | None):
        try:
            import ray
        except ImportError:
            from tidal.config import ConfigError

            raise ConfigError("executor=ray needs Ray: pip install 'tidal[ray]'") from None
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            import os

            os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")  # slow GCS start on a busy machine
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.blocks_ref = ray.put([b if b.parallel else None for b in blocks])
        self.fn = ray.remote(_ray_prepare)

    def map(self, index: int, parts: list[list[Row]]) -> list[list[Any]]:
        return self.ray.get([self.fn.remote(self.blocks_ref, index, part) for part in parts])

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


class Pipeline:
    """Run ``blocks`` over rows. ``workers > 1`` runs every block's ``prepare`` in a process pool
    (blocks are sent to each worker once, so a big n-gram index is not re-pickled per chunk);
    ``executor="ray"`` runs it as Ray tasks on every CPU of a Ray cluster instead."""

    def __init__(self, blocks: list[Block], workers: int = 1, chunk_size: int = 1024, max_examples: int = 5,
                 executor: str = "local", ray_address: str | None = None):
        assert blocks, "a pipeline needs at least one block"
        names = [b.name for b in blocks]
        assert len(set(names)) == len(names), f"block names must be unique, got {names}"
        assert executor in ("local", "ray"), f"executor must be 'local' or 'ray', got {executor!r}"
        self.blocks = blocks
        self.workers = max(1, workers)
        self.executor, self.ray_address = executor, ray_address
        self.chunk_size = chunk_size
        self.max_examples = max_examples
        self.stats = [BlockStats(b.name) for b in blocks]
        self.rows_in = self.rows_out = 0
        self.seconds = 0.0

    def run(self, rows: Iterable[Row]) -> Iterator[Row]:
        """The kept rows, in input order, streamed chunk by chunk (rows numbered 1, 2, ... in the report)."""
        return self.run_numbered(enumerate(rows, 1))

    def run_numbered(self, numbered: Iterable[tuple[int, Row]]) -> Iterator[Row]:
        """``run`` for ``(number, row)`` pairs: the report names dropped rows by these numbers (the input's
        line numbers, from ``io.read_numbered``, so they stay right when malformed lines were skipped)."""
        pool = None
        if self.executor == "ray":
            pool = _RayPool(self.blocks, self.ray_address)
            self.workers = pool.workers
        elif self.workers > 1:
            pool = _ProcessPool(self.blocks, self.workers)
        start = time.perf_counter()
        try:
            it = iter(numbered)
            while pairs := list(islice(it, self.chunk_size)):
                positions = [n for n, _ in pairs]
                chunk = [row for _, row in pairs]
                self.rows_in += len(chunk)
                for i, (block, stats) in enumerate(zip(self.blocks, self.stats)):
                    if not chunk:
                        break
                    chunk, positions = self._apply(i, block, stats, chunk, positions, pool)
                self.rows_out += len(chunk)
                self.seconds = time.perf_counter() - start
                yield from chunk
        finally:
            self.seconds = time.perf_counter() - start
            if pool is not None:
                pool.close()

    def _apply(self, i: int, block: Block, stats: BlockStats, chunk: list[Row], positions: list[int], pool):
        t0 = time.perf_counter()
        if pool is None or not block.parallel:
            prepared = block.prepare_chunk(chunk)
        else:
            step = -(-len(chunk) // pool.workers)
            parts = pool.map(i, [chunk[k : k + step] for k in range(0, len(chunk), step)])
            prepared = [p for part in parts for p in part]
        kept, kept_pos = [], []
        for row, pos, prep in zip(chunk, positions, prepared):
            block.row_number = pos
            reason = block.decide(row, prep)
            if reason is None:
                kept.append(block.transform(row, prep))
                kept_pos.append(pos)
            else:
                stats.dropped[reason] += 1
                if block.keep_all_examples or len(stats.examples) < self.max_examples:
                    example = {"row": pos, "reason": reason}
                    if block.detail is not None:
                        example["detail"] = block.detail
                    stats.examples.append(example)
        stats.seen += len(chunk)
        stats.kept += len(kept)
        stats.seconds += time.perf_counter() - t0
        return kept, kept_pos

    def report(self) -> dict[str, Any]:
        """Per-block counts (seen = kept + dropped; each block sees what the previous one kept)."""
        return {
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "seconds": round(self.seconds, 4),
            "rows_per_s": self.rows_in / self.seconds if self.seconds else None,
            "workers": self.workers,
            "blocks": [s.as_dict(b.summary()) for b, s in zip(self.blocks, self.stats)],
        }
