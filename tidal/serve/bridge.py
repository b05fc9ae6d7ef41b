"""One engine thread, many HTTP requests: the bridge between the server's event loop and a RolloutEngine.

A RolloutEngine batches through ``stream(source, on_done)``: it pulls requests whenever a slot is free
and hands back each trajectory as soon as it finishes. The HTTP server, by contrast, receives one
request at a time from many concurrent agents. ``EngineBridge`` runs ``stream`` on a single daemon
thread and feeds it from a queue; ``submit`` returns a ``concurrent.futures.Future`` that the engine
thread resolves in ``on_done``, so each HTTP handler awaits its own result
(``asyncio.wrap_future``) while all episodes' turns share one continuous batch, and a weight update
(``request_weight_update``, thread-safe on every engine) interrupts them all at once.

**An engine error fails only the request that caused it.** ``stream`` has no per-request error
channel: a request the engine cannot run (before the server validated token ids, ``[5, 99999]`` was an
``IndexError`` in the embedding) raises out of ``stream`` and takes the whole batch with it. The
bridge used to end its thread there, so every later request of every episode got 503 until restart.
Now it restarts ``stream`` and finds the culprit among the requests that were in the engine by
halving: each half runs alone (nothing else admitted meanwhile), a half that fails is halved again,
and a request that fails alone gets the error (``RequestFailed``); the others are served, in about
2 log2(k) runs for k requests in flight. Only an error nothing can be blamed for ends the engine:
one raised with no request in the engine (a failed weight update: the local engine keeps it pending,
so it is raised again before any request), or a second request failing alone with none served in
between (the engine fails whatever it runs). Then ``error`` is set, every waiting and later request
gets ``EngineClosed``, and ``check`` raises ``EngineFailed``: a run stops on it (``HarnessEngine``)
rather than training on nothing.

The engine is never called from another thread except for ``request_weight_update`` and ``stats``
(which the engines allow); a request whose HTTP client went away still finishes in the engine (a
local engine cannot cancel one row) and the handler drops its result (``server.py``).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future

from tidal.api import EngineFailed, GenRequest, RolloutEngine
from tidal.types import Trajectory

FAILURES_IN_A_ROW = 2
"""Requests failing alone, with none served in between, that mean the engine itself is failing."""


class EngineClosed(RuntimeError):
    """The bridge was closed (or its engine failed) before the request could run."""


class RequestFailed(RuntimeError):
    """The engine raised on this request when it ran alone (see module docstring)."""


class EngineBridge:
    """Runs ``engine.stream`` on one thread, fed by ``submit`` (see module docstring)."""

    def __init__(self, engine: RolloutEngine, poll_s: float = 0.05, greedy: bool = False):
        self.engine = engine
        self.greedy = greedy  # the engine decodes greedily (an evaluation server)
        self.poll_s = poll_s  # how long an idle engine waits on the queue before re-checking for close
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._in_engine: dict[int, GenRequest] = {}  # handed to the engine, not finished (admission order)
        self._suspects: deque[list[GenRequest]] = deque()  # after an engine error: groups to run alone
        self._failed_alone = 0  # requests that failed alone since the last one served
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.max_in_flight = 0  # most requests inside the engine at once: > 1 means turns shared a batch
        self.num_requests = 0
        self.num_failed = 0  # requests the engine failed on (RequestFailed)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tidal-serve-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self._in_engine)

    def submit(self, request: GenRequest) -> Future:
        """Queue ``request``; the future resolves to its Trajectory (or raises ``RequestFailed`` or
        ``EngineClosed``)."""
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

    def check(self) -> None:
        """Raise ``EngineFailed`` once the engine has failed (module docstring): its user must stop."""
        if self.error is not None:
            raise EngineFailed(self._why_closed())

    def _why_closed(self) -> str:
        if self.error is not None:
            return f"the rollout engine failed: {type(self.error).__name__}: {self.error}"
        return "the server is shutting down"

    # ---- the engine thread ---------------------------------------------------------------------
    def _source(self, n: int, block: bool) -> list[GenRequest] | None:
        if self._suspects:  # after an engine error: the next group runs alone
            if self._in_engine:
                return []
            group = self._suspects.popleft()
            if len(group) > n:  # at most n, as ``stream`` asks (an engine may have fewer slots now): the rest next
                group, rest = group[:n], group[n:]
                self._suspects.appendleft(rest)
            return self._admit(group)
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
        return self._admit(out)

    def _admit(self, requests: list[GenRequest]) -> list[GenRequest]:
        with self._lock:
            self._in_engine.update((id(r), r) for r in requests)
            self.max_in_flight = max(self.max_in_flight, len(self._in_engine))
        return requests

    def _on_done(self, request: GenRequest, traj: Trajectory) -> None:
        with self._lock:
            del self._in_engine[id(request)]
            future = self._futures.pop(id(request))
            self._failed_alone = 0
        future.set_result(traj)

    def _run(self) -> None:
        while True:
            try:
                self.engine.stream(self._source, self._on_done, greedy=self.greedy)
                break  # closed, and everything it held finished
            except BaseException as e:  # noqa: BLE001  (blamed on a request, or reported to every waiting one)
                if not self._blame(e):
                    self.error = e
                    self._closed.set()
                    break
        self._fail_pending(EngineClosed(self._why_closed()))

    def _blame(self, error: BaseException) -> bool:
        """After ``stream`` raised: queue the requests it held to run alone in halves, or fail the one
        that failed alone. False when the engine itself has failed (module docstring)."""
        with self._lock:
            held, self._in_engine = list(self._in_engine.values()), {}
        if not held or not isinstance(error, Exception):
            return False
        if len(held) > 1:
            half = len(held) // 2
            self._suspects.extendleft([held[half:], held[:half]])  # the first half runs next
            return True
        with self._lock:
            future = self._futures.pop(id(held[0]))
            self._failed_alone += 1
            self.num_failed += 1
            failed_alone = self._failed_alone
        future.set_exception(RequestFailed(f"the rollout engine failed on this request: "
                                           f"{type(error).__name__}: {error}"))
        return failed_alone < FAILURES_IN_A_ROW

    def _fail_pending(self, error: EngineClosed) -> None:
        with self._lock:
            pending, self._futures = self._futures, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
