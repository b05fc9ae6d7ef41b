"""The group journal: scored groups persisted the moment they are scored, so a stopped run loses none.

In async mode the scorer appends every scored group to ``RUN_DIR/journal.jsonl`` (one JSON object
per line: the group's index in the prompt stream and the group itself, flushed at once) before the
trainer can take it. Stopping a run (Ctrl-C, a time limit, a crash) loses at most the groups still
being generated; ``--resume`` reloads the journaled groups the restored checkpoint has not trained
and trains them instead of generating them again.

Which groups are reused, and why the staleness accounting stays exact:

- Only groups at or after the checkpoint's cursor (``TrainingState.next_group``): those before it
  were trained (or charged) before the checkpoint.
- Only groups whose every token was sampled by a policy version <= the checkpoint's version. A
  checkpoint older than the stop (a hard crash between checkpoints) restores a policy that never
  had the later versions' weights; samples from those versions belong to a history the resumed run
  does not share, so they are generated again.
- A reused group passes through admission like a generated one (``StalenessManager.admit`` counts
  it when the generator reaches its index), so ``num_admitted = version * P`` at resume holds and
  the capacity rule is unchanged. If a reused group is older than eta versions by the step that
  trains it, ``collect_batch``'s staleness guard drops and counts it (``async/dropped_stale``), as
  for any other group: the bound is never exceeded.

A torn last line (the process died mid-write) is skipped. The file is compacted at each checkpoint
to the groups the checkpoint has not trained, and at resume to the groups reused.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import IO

from tidal.models.moe import decode_routes, encode_routes
from tidal.types import Group, Prompt, Trajectory

log = logging.getLogger(__name__)


def group_to_json(index: int, group: Group) -> str:
    # vars() rather than dataclasses.asdict: no deep copy (this runs on the scorer thread).
    record = {"prompt": vars(group.prompt), "trajectories": [_trajectory_dict(t) for t in group.trajectories]}
    return json.dumps({"index": index, "group": record}, default=str)


def _trajectory_dict(t: Trajectory) -> dict:
    """``vars(t)``, an MoE sample's routes (a uint8 tensor) as ``encode_routes`` writes them."""
    return vars(t) if t.routes is None else {**vars(t), "routes": encode_routes(t.routes)}


def group_from_dict(d: dict) -> Group:
    trajs = [Trajectory(**{**t, "routes": decode_routes(t["routes"])} if t.get("routes") is not None
                        else t) for t in d["trajectories"]]
    return Group(Prompt(**d["prompt"]), trajs)


def newest_version(group: Group) -> int:
    return max((v for t in group.trajectories for v in t.versions), default=-1)


class GroupJournal:
    """Append-only JSONL of scored groups keyed by stream index (thread-safe).

    ``append`` only queues the group; a writer thread serializes and writes it, so the scorer's
    timing (which decides when the generator may admit more groups) does not depend on the disk.
    Every other method first waits until the queue is written (``flush``)."""

    def __init__(self, path: str | Path, fresh: bool):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._queue: queue.Queue[tuple[int, Group]] = queue.Queue()
        self._writer: threading.Thread | None = None
        self.num_failed = 0
        if fresh:
            self.path.unlink(missing_ok=True)

    def append(self, index: int, group: Group) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_forever, name="tidal-journal", daemon=True)
            self._writer.start()
        self._queue.put((index, group))

    def _write_forever(self) -> None:
        while True:
            index, group = self._queue.get()
            try:
                line = group_to_json(index, group) + "\n"
                with self._lock:
                    if self._file is None:
                        self.path.parent.mkdir(parents=True, exist_ok=True)
                        self._file = self.path.open("a")
                    self._file.write(line)
                    self._file.flush()  # in the OS's hands: survives the process being killed
            except Exception as e:  # the journal only saves regeneration on resume: warn, never stop the run
                self.num_failed += 1
                with self._lock:  # drop the handle: its unwritten buffer would fail again at every close
                    if self._file is not None:
                        try:
                            self._file.close()
                        except OSError:
                            pass
                        self._file = None
                if self.num_failed == 1:
                    log.warning("journal %s: could not write group %d (%s); it would be generated again "
                                "after --resume", self.path, index, e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every appended group is written."""
        self._queue.join()

    def _read(self) -> dict[int, str]:
        """index -> the newest line for it; torn or unreadable lines are skipped."""
        lines: dict[int, str] = {}
        if not self.path.exists():
            return lines
        for line in self.path.read_text().splitlines():
            try:
                lines[int(json.loads(line)["index"])] = line
            except (ValueError, KeyError, TypeError):
                continue
        return lines

    def _rewrite(self, lines: dict[int, str]) -> None:
        """Replace the file with ``lines`` atomically (caller holds the lock)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(lines[i] + "\n" for i in sorted(lines)))
        os.replace(tmp, self.path)

    def compact(self, start: int) -> None:
        """Drop the groups before ``start`` (trained, per the checkpoint just written)."""
        self.flush()
        with self._lock:
            lines = self._read()
            if any(i < start for i in lines):
                self._rewrite({i: s for i, s in lines.items() if i >= start})

    def reload(self, start: int, max_version: int) -> tuple[dict[int, Group], int]:
        """The journaled groups a run resumed at cursor ``start`` and policy version ``max_version``
        may train (see the module docstring), and how many later groups were discarded. The file is
        rewritten to hold only the returned groups."""
        self.flush()
        with self._lock:
            keep: dict[int, str] = {}
            groups: dict[int, Group] = {}
            discarded = 0
            for i, line in self._read().items():
                if i < start:
                    continue
                group = group_from_dict(json.loads(line)["group"])
                if newest_version(group) > max_version:
                    discarded += 1
                    continue
                keep[i], groups[i] = line, group
            if self.path.exists():
                self._rewrite(keep)
            return groups, discarded

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
