"""The Ray backend's rollout side: N rollout workers as Ray actors behind one ``RolloutEngine``.

Each worker is a Ray actor holding an engine built from the ``ENGINES`` registry (``rollout.engine``,
the CPU ``LocalEngine`` by default), placed by the resources it asks for (``num_cpus``/``num_gpus``).
Inside the actor the engine runs its own continuous batching on a thread, fed from an inbox and
emptied into an outbox. ``RayEngine`` lives in the driver and implements the same protocol as a
local engine, so the controller's semantics (versions, staleness bound, interruption) do not change
with the backend:

- ``stream(source, on_done)`` pulls requests from ``source`` whenever the workers have room,
  places each group on the least-loaded worker (``dispatch.py``) and hands every finished
  trajectory to ``on_done`` on the calling thread, exactly once.
- ``request_weight_update`` puts the state dict into the object store once (``ray.put``, as numpy
  arrays: workers on a node read them from shared memory without copying) and every worker stages
  it; the call returns only when every live worker holds the new version, so a request admitted
  afterwards (at the new version) is never sampled with older weights. Each worker applies it at
  its next interruption point, re-reading its unfinished rows, exactly as the local engine does.
- A worker that dies (its poll raises ``RayActorError``) has its requests re-queued to the
  survivors and the run goes on with fewer workers (Gemini 2.5's lesson); with
  ``system.rollout_worker_restarts`` > 0 a replacement starts with the latest weights and joins once
  it holds the current version. When the last worker is gone the stream raises.

The trainer stays in the driver process (a distributed trainer is a separate piece of work).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.api import GenRequest
from tidal.models.tied import load_weights
from tidal.rollout import ENGINES
from tidal.rollout.requests import generate_by_stream
from tidal.system.dispatch import Dispatch
from tidal.types import Trajectory

log = logging.getLogger(__name__)

POLL_S = 1.0
"""How long a worker's ``poll`` waits for a finished trajectory before answering empty."""
WAIT_S = 0.05
"""How often the driver asks ``source`` for newly admitted requests while results are pending."""


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("system.backend=ray needs Ray: pip install 'ray[default]==2.60.*' "
                          "(or pip install 'tidal[ray]')") from e
    return ray


def init_ray(address: str | None) -> bool:
    """Join the cluster at ``address`` (``auto``, ``HOST:6379`` or ``ray://HOST:10001``), or start a
    local Ray instance when it is None, unless Ray is already initialized in this process.
    Returns True when this call connected, i.e. the caller should ``ray.shutdown()`` at the end."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    # A busy machine starts Ray's GCS slowly; Ray's default ~20-30 s wait for it failed in CI here.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True


def to_arrays(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, str]]:
    """Tensors as numpy arrays (dtypes numpy lacks, e.g. bfloat16, as raw bytes plus the dtype's name).
    Ray stores numpy arrays once in the node's shared memory and every worker there reads them
    without a copy; torch tensors would be pickled, i.e. copied on both sides."""
    out = {}
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        try:
            out[name] = (t.numpy(), "")
        except TypeError:
            out[name] = (t.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."))
    return out


def from_arrays(arrays: Mapping[str, tuple[Any, str]]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_arrays``. The tensors share the (read-only) object-store memory; they are only
    read, by ``load_weights``, which copies them into the model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(a).view(getattr(torch, dtype)) if dtype else torch.from_numpy(a)
                for name, (a, dtype) in arrays.items()}


def actor_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the actor is gone (as opposed to a bug raised inside it)."""
    ray = require_ray()
    errors: list[type[BaseException]] = [ray.exceptions.RayActorError]
    if hasattr(ray.exceptions, "ActorUnavailableError"):
        errors.append(ray.exceptions.ActorUnavailableError)
    return tuple(errors)


class RolloutWorker:
    """Runs inside a Ray actor (threaded, so ``poll``, ``submit`` and ``update_weights`` overlap
    with generation): one engine from ``ENGINES`` serving an inbox on its own thread."""

    def __init__(self, engine: str, model, tokenizer, cfg, seed: int, version: int,
                 arrays: Mapping[str, tuple[Any, str]] | None, num_threads: int):
        torch.set_num_threads(num_threads)
        if arrays is not None:  # a replacement worker: start from the newest weights (a tied head comes once)
            load_weights(model, from_arrays(arrays))
        self.engine = ENGINES.get(engine)(model, tokenizer, cfg, seed, version)
        self._staged = version
        self._cond = threading.Condition()
        self._inbox: deque[tuple[int, GenRequest, bool]] = deque()
        self._outbox: list[tuple[int, Trajectory]] = []
        self._ids: dict[int, tuple[int, GenRequest]] = {}  # id(request) -> (request id, request)
        self._error: BaseException | None = None
        threading.Thread(target=self._serve, name="tidal-rollout-worker", daemon=True).start()

    def ready(self) -> int:
        """The version this worker holds (staged or loaded)."""
        return self._staged

    def submit(self, batch: list[tuple[int, GenRequest]], greedy: bool) -> None:
        with self._cond:
            self._inbox.extend((rid, request, greedy) for rid, request in batch)
            self._cond.notify_all()

    def poll(self, timeout: float) -> tuple[list[tuple[int, Trajectory]], dict[str, float]]:
        """Finished (request id, trajectory) pairs, waiting up to ``timeout`` for the first one."""
        with self._cond:
            self._cond.wait_for(lambda: self._outbox or self._error is not None, timeout=timeout)
            if self._error is not None:
                raise RuntimeError("rollout worker's engine failed") from self._error
            out, self._outbox = self._outbox, []
        return out, self.engine.stats()

    def update_weights(self, arrays: Mapping[str, tuple[Any, str]], version: int) -> int:
        """Stage ``version`` unless this worker already holds it or a newer one (calls may overlap)."""
        with self._cond:
            if version > self._staged:
                self._staged = version
                self.engine.request_weight_update(from_arrays(arrays), version)
            return self._staged

    # ---- the serving thread --------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._inbox))
                    greedy = self._inbox[0][2]
                self.engine.stream(functools.partial(self._source, greedy=greedy), self._on_done, greedy=greedy)
        except BaseException as e:  # reported to the driver by the next poll
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _source(self, n: int, block: bool, greedy: bool) -> list[GenRequest] | None:
        with self._cond:
            if block:
                self._cond.wait_for(lambda: bool(self._inbox), timeout=POLL_S)
            if self._inbox and self._inbox[0][2] != greedy:
                return None  # ends this stream once its rows finish; the next one samples the other way
            taken = []
            while self._inbox and len(taken) < n and self._inbox[0][2] == greedy:
                rid, request, _ = self._inbox.popleft()
                self._ids[id(request)] = (rid, request)
                taken.append(request)
            return taken

    def _on_done(self, request: GenRequest, traj: Trajectory) -> None:
        with self._cond:
            rid, _ = self._ids.pop(id(request))
            self._outbox.append((rid, traj))
            self._cond.notify_all()


@dataclass
class _Worker:
    actor: Any
    seat: int  # which of the configured workers this is; a replacement takes the dead one's seat
    ready_ref: Any = None  # set while starting (not yet given requests)
    poll_ref: Any = None  # set while alive
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.ready_ref is None


@dataclass
class RayEngineConfig:
    """How the rollout workers are placed (filled from ``system.*``)."""

    engine: str = "local"
    num_workers: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_threads: int = 1
    max_restarts: int = 0
    start_timeout_s: float = 300.0


class RayEngine:
    """A ``RolloutEngine`` over Ray actors (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg, seed: int, version: int, rcfg: RayEngineConfig):
        ray = require_ray()
        assert rcfg.num_workers > 0, "system.rollout_workers must be >= 1"
        self._ray = ray
        self._errors = actor_errors()
        self.cfg = cfg
        self.rcfg = rcfg
        self.seed = seed
        self.version = version
        self.owns_ray = False  # set by whoever started Ray for this engine: close() then shuts it down
        self._actor_cls = ray.remote(RolloutWorker).options(
            num_cpus=rcfg.num_cpus, num_gpus=rcfg.num_gpus, max_concurrency=8, max_restarts=0)
        self._model_ref = ray.put(model)
        self._tokenizer_ref = ray.put(tokenizer)
        self._weights: tuple[Any, int] | None = None  # (object ref, version) of the newest weights
        self._lock = threading.Lock()  # guards _workers and _weights (trainer thread vs stream thread)
        self._workers: dict[int, _Worker] = {}
        self._next_id = 0
        self._restarts_left = {seat: rcfg.max_restarts for seat in range(rcfg.num_workers)}
        self.dispatch = Dispatch(cfg.max_batch_size)
        self.num_worker_deaths = 0
        self.num_weight_syncs = 0
        self.last_sync_s = 0.0
        t0 = time.perf_counter()
        for seat in range(rcfg.num_workers):
            self._start(seat)
        self._wait_started()
        self.start_s = time.perf_counter() - t0

    # ---- workers -------------------------------------------------------------------------------
    def _start(self, seat: int) -> None:
        ref, version = self._weights if self._weights is not None else (None, self.version)
        actor = self._actor_cls.remote(self.rcfg.engine, self._model_ref, self._tokenizer_ref, self.cfg, self.seed,
                                       version, ref, self.rcfg.num_threads)
        with self._lock:
            wid, self._next_id = self._next_id, self._next_id + 1
            self._workers[wid] = _Worker(actor, seat, ready_ref=actor.ready.remote())

    def _wait_started(self) -> None:
        refs = {w.ready_ref: wid for wid, w in self._workers.items()}
        ready, pending = self._ray.wait(list(refs), num_returns=len(refs), timeout=self.rcfg.start_timeout_s)
        if pending:
            raise RuntimeError(
                f"{len(pending)} of {len(refs)} rollout workers did not start within {self.rcfg.start_timeout_s:.0f}s; "
                f"each asks for num_cpus={self.rcfg.num_cpus}, num_gpus={self.rcfg.num_gpus} and the cluster has "
                f"{self._ray.cluster_resources()} (lower system.rollout_workers or system.rollout_worker_cpus)")
        for ref in ready:
            self._promote(refs[ref], ref)
        assert all(w.alive for w in self._workers.values()), "a rollout worker failed to start"

    def _promote(self, wid: int, ref) -> None:
        """A starting worker answered: it joins if it holds the newest weights, else it gets them first."""
        try:
            version = self._ray.get(ref)
        except self._errors:
            self._on_death(wid)
            return
        with self._lock:
            w = self._workers[wid]
            if self._weights is not None and version < self._weights[1]:
                w.ready_ref = w.actor.update_weights.remote(*self._weights)
                return
            w.ready_ref = None
        self.dispatch.add_worker(wid)
        w.poll_ref = w.actor.poll.remote(POLL_S)

    def _on_death(self, wid: int) -> None:
        with self._lock:
            w = self._workers.pop(wid)
        lost = self.dispatch.fail(wid) if wid in self.dispatch.load else []
        self.num_worker_deaths += 1
        self._ray.kill(w.actor)  # no-op when it is already gone
        restart = self._restarts_left[w.seat] > 0
        log.warning("rollout worker %d (seat %d) died: %d requests re-queued to %d live workers%s", wid, w.seat,
                    len(lost), self.num_alive, "; starting a replacement" if restart else "")
        if restart:
            self._restarts_left[w.seat] -= 1
            self._start(w.seat)

    @property
    def num_alive(self) -> int:
        with self._lock:
            return sum(w.alive for w in self._workers.values())

    def actors(self) -> list[Any]:
        """Handles of the live workers (tests kill them)."""
        with self._lock:
            return [w.actor for w in self._workers.values() if w.alive]

    # ---- weights -------------------------------------------------------------------------------
    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """One ``ray.put``; every live worker stages it before this returns (see module docstring)."""
        t0 = time.perf_counter()
        ref = self._ray.put(to_arrays(state_dict))
        with self._lock:
            self._weights = (ref, version)
            self.version = version
            calls = [w.actor.update_weights.remote(ref, version) for w in self._workers.values() if w.alive]
            # A starting worker is checked again when it answers (``_promote``): no need to wait for it.
        for call in calls:
            try:
                self._ray.get(call)
            except self._errors:
                pass  # that worker is dead: the stream sees it through its poll and re-queues its requests
        self.num_weight_syncs += 1
        self.last_sync_s = time.perf_counter() - t0

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        return generate_by_stream(self.stream, requests, greedy)

    def stream(self, source: Callable[[int, bool], list[GenRequest] | None],
               on_done: Callable[[GenRequest, Trajectory], None], greedy: bool = False) -> None:
        """Continuous batching over the workers; returns when ``source`` is exhausted and every
        request has been delivered. ``source(n, block)`` blocks only when nothing is in flight."""
        d = self.dispatch
        exhausted = False
        while True:
            if not exhausted and d.load:
                free = d.free()
                if free > 0:
                    new = source(free, d.idle)
                    if new is None:
                        exhausted = True
                    elif new:
                        d.add(new)
            for wid, batch in d.assign().items():
                self._workers[wid].actor.submit.remote(batch, greedy)
            if exhausted and d.idle:
                return
            with self._lock:
                waits = {(w.poll_ref if w.alive else w.ready_ref): wid for wid, w in self._workers.items()}
            if not waits:
                raise RuntimeError(f"every rollout worker died ({self.num_worker_deaths} deaths, restarts used up); "
                                   f"{len(d.requests)} requests were not generated")
            ready, _ = self._ray.wait(list(waits), num_returns=1, timeout=None if exhausted else WAIT_S)
            for ref in ready:
                wid = waits[ref]
                if self._workers[wid].alive:
                    self._collect(wid, ref, on_done)
                else:
                    self._promote(wid, ref)

    def _collect(self, wid: int, ref, on_done) -> None:
        try:
            results, stats = self._ray.get(ref)
        except self._errors:
            self._on_death(wid)
            return
        w = self._workers[wid]
        w.stats = stats
        w.poll_ref = w.actor.poll.remote(POLL_S)
        for rid, traj in results:
            request = self.dispatch.complete(wid, rid)
            traj.worker = w.seat  # the SDC guard compares the engines' log-probs worker by worker
            if request is not None:
                on_done(request, traj)

    # ---- metrics and shutdown ------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        with self._lock:
            live = [w.stats for w in self._workers.values() if w.alive]
        out = {
            "perf/gen_tokens_per_s": sum(s.get("perf/gen_tokens_per_s", 0.0) for s in live),  # workers run in parallel
            "rollout/interruptions": sum(s.get("rollout/interruptions", 0.0) for s in live),
            "rollout/weight_updates": float(self.num_weight_syncs),
            "system/rollout_workers_alive": float(len(live)),
            "system/requeued_requests": float(self.dispatch.num_requeued),
        }
        return out

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            self._ray.kill(w.actor)
        if self.owns_ray:
            self._ray.shutdown()
