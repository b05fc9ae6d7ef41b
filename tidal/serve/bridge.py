"""One engine thread, many HTTP requests: the bridge between the server's event loop and a RolloutEngine.

A RolloutEngine batches through ``stream(source, on_done)``: it pulls requests whenever a slot is free
and hands back each trajectory as soon as it finishes. The HTTP server, by contrast, receives one
request at a time from many concurrent agents. ``EngineBridge`` runs ``stream`` on a single daemon
thread and feeds it from a queue; ``submit`` returns a ``concurrent.futures.Future`` that the engine
thread resolves in ``on_done``, so each HTTP handler awaits its own result
(``asyncio.wrap_future``) while all episodes' turns share one continuous batch, and a weight update
(``request_weight_update``, thread-safe on every engine) interrupts them all at once.

The engine is never called from another thread except for ``request_weight_update`` and ``stats``
(which the engines allow); a request whose HTTP client went away still finishes in the engine and
its result is dropped by the handler, because a local engine cannot cancel one row.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from tidal.api import GenRequest, RolloutEngine
from tidal.types import Trajectory


class EngineClosed(RuntimeError):
    """The bridge was closed (or its engine thread died) before the request could run."""


class EngineBridge:
    """Runs ``engine.stream`` on one thread, fed by ``submit`` (see module docstring)."""

    def __init__(self, engine: RolloutEngine, poll_s: float = 0.05, greedy: bool = False):
        self.engine = engine
        self.greedy = greedy  # the engine decodes greedily (an evaluation server)
        self.poll_s = poll_s  # how long an idle engine waits on the queue before re-checking for close
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0  # most requests inside the engine at once: > 1 means turns shared a batch
        self.num_requests = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tidal-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest) -> Future:
        """Queue ``request``; the future resolves to its Trajectory (or raises ``EngineClosed``)."""
        future: Future = Future()
        with self._lock:
            if self._closed.is_set():
                raise EngineClosed(self._why_closed())
            self._futures[id(request)] = future
            self.num_requests += 1
        self._queue.put(request)
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests; the engine finishes what it holds, then its thread ends."""
        self._closed.set()
        self._thread.join(timeout_s)
        self._fail_pending(EngineClosed(self._why_closed()))

    def _why_closed(self) -> str:
        if self.error is not None:
            return f"the rollout engine failed: {type(self.error).__name__}: {self.error}"
        return "the server is shutting down"

    # ---- the engine thread ---------------------------------------------------------------------
    def _source(self, n: int, block: bool) -> list[GenRequest] | None:
        out: list[GenRequest] = []
        try:
            if block:  # nothing is decoding: wait for work rather than spin
                out.append(self._queue.get(timeout=self.poll_s))
            while len(out) < n:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        if not out and self._closed.is_set():
            return None
        with self._lock:
            self.in_flight += len(out)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return out

    def _on_done(self, request: GenRequest, traj: Trajectory) -> None:
        with self._lock:
            self.in_flight -= 1
            future = self._futures.pop(id(request))
        future.set_result(traj)

    def _run(self) -> None:
        try:
            self.engine.stream(self._source, self._on_done, greedy=self.greedy)
        except BaseException as e:  # noqa: BLE001  (reported to every waiting request, never swallowed)
            self.error = e
            self._closed.set()
        self._fail_pending(EngineClosed(self._why_closed()))

    def _fail_pending(self, error: EngineClosed) -> None:
        with self._lock:
            pending, self._futures = self._futures, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
