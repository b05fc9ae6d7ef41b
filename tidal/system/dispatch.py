"""Request bookkeeping for an engine spread over several workers: least-loaded placement, exactly-once
delivery, and re-queueing when a worker dies (pure Python, no Ray; ``ray_engine.py`` drives it).

Every request gets an id when it enters. It is either queued (waiting for a worker) or owned by one
worker. Three rules make the fault tolerance hold:

1. A finished trajectory is delivered only if its worker still owns the request (``complete``), and
   ownership ends at delivery, so a late or repeated result is ignored: each request's trajectory
   is delivered exactly once.
2. A worker that dies gives all its requests back to the front of the queue (``fail``); the
   survivors generate them again. Sampling noise is keyed by (seed, prompt uid, sample index,
   position), so under the same weights the survivor samples the very tokens the dead worker was
   sampling: no sample is lost and none changes.
3. Placement keeps a group's adjacent requests together (one prompt prefill per group, as in the
   local engine) and sends each group to the worker with the fewest requests in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tidal.api import GenRequest


class Dispatch:
    """Who holds which request (see module docstring). ``capacity``: most requests one worker holds."""

    def __init__(self, capacity: int):
        assert capacity > 0, f"worker capacity must be positive, got {capacity}"
        self.capacity = capacity
        self.requests: dict[int, GenRequest] = {}  # id -> request, queued or in flight
        self.owner: dict[int, int] = {}  # id -> worker, for requests in flight
        self.load: dict[int, set[int]] = {}  # worker -> ids it holds
        self.queue: deque[int] = deque()  # ids waiting for a worker, oldest first
        self.num_requeued = 0
        self.num_delivered = 0
        self._next_id = 0

    # ---- workers -------------------------------------------------------------------------------
    def add_worker(self, worker: int) -> None:
        assert worker not in self.load, f"worker {worker} added twice"
        self.load[worker] = set()

    def fail(self, worker: int) -> list[int]:
        """``worker`` died: its requests go back to the front of the queue (in their original order,
        so groups stay adjacent). Returns their ids."""
        lost = sorted(self.load.pop(worker))
        for rid in lost:
            del self.owner[rid]
        self.queue.extendleft(reversed(lost))
        self.num_requeued += len(lost)
        return lost

    @property
    def workers(self) -> list[int]:
        return list(self.load)

    # ---- requests ------------------------------------------------------------------------------
    def add(self, requests: Iterable[GenRequest]) -> list[int]:
        """Queue new requests; return their ids."""
        ids = []
        for request in requests:
            rid, self._next_id = self._next_id, self._next_id + 1
            self.requests[rid] = request
            self.queue.append(rid)
            ids.append(rid)
        return ids

    def free(self) -> int:
        """Rows the live workers could still take, minus what already waits in the queue."""
        return sum(self.capacity - len(ids) for ids in self.load.values()) - len(self.queue)

    def assign(self) -> dict[int, list[tuple[int, GenRequest]]]:
        """Place queued requests, a group (adjacent requests of one prompt) at a time, each on the
        least-loaded worker that has room for the whole group. Returns {worker: [(id, request)]}."""
        placed: dict[int, list[tuple[int, GenRequest]]] = {}
        while self.queue and self.load:
            uid = self.requests[self.queue[0]].prompt.uid
            size = 1
            while size < len(self.queue) and self.requests[self.queue[size]].prompt.uid == uid:
                size += 1
            size = min(size, self.capacity)  # a group larger than one worker is split
            worker = min(self.load, key=lambda w: (len(self.load[w]), w))
            if len(self.load[worker]) + size > self.capacity:
                break  # every worker is full: wait for some rows to finish
            for _ in range(size):
                rid = self.queue.popleft()
                self.owner[rid] = worker
                self.load[worker].add(rid)
                placed.setdefault(worker, []).append((rid, self.requests[rid]))
        return placed

    def complete(self, worker: int, rid: int) -> GenRequest | None:
        """``worker`` finished ``rid``: the request to deliver, or None when the worker no longer owns
        it (a result from a worker already declared dead, or a repeat): never deliver twice."""
        if self.owner.get(rid) != worker:
            return None
        del self.owner[rid]
        self.load[worker].discard(rid)
        self.num_delivered += 1
        return self.requests.pop(rid)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self.requests

    def in_flight(self, worker: int) -> int:
        return len(self.load.get(worker, ()))
