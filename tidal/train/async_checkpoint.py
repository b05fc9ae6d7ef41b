"""Asynchronous checkpoints: the step pays for a host snapshot; a background thread writes, hashes and renames.

A synchronous checkpoint (``checkpoint.save_checkpoint``) stops training while it serializes, writes and
hashes every file. DataStates-LLM (arXiv 2406.10707) and Universal Checkpointing (arXiv 2406.18820) make the
step pay only for a copy of the state into host memory and flush that copy in the background; six of the
nine peers we track checkpoint asynchronously. ``AsyncCheckpointer.save``:

1. waits for the previous write, if one is still running (at most one write is in flight: the snapshot
   buffers are reused, and a backlog of copies would grow without bound when writes are slower than steps);
   a write that failed raises its ``CheckpointError`` here;
2. takes the snapshot (``snapshot.py``; a sharded model's full state is gathered first, collectively, as
   the synchronous save does);
3. starts a thread that runs ``checkpoint.write_checkpoint`` on the snapshot, with the same files, the same
   ``hashes.json``, the same ``.tmp_step_<k>`` then rename then ``latest`` order and the same retention as a
   synchronous save, then ``on_saved(path)``.

So the on-disk format, ``latest_checkpoint``, ``load_checkpoint``, ``verify_hashes`` and ``--resume`` are
unchanged, and a process killed mid-write (``kill -9``) leaves a ``.tmp_step_<k>`` that is never read and
the previous complete checkpoint in place. Retention runs after the rename and never removes the checkpoint
just written: the newest complete checkpoint is never deleted, in flight or not. ``wait()`` is the caller's
promise that a run that ends or is interrupted does not exit before its last checkpoint is on disk (the
thread is also non-daemon, so the interpreter waits for it at exit).

Why not ``torch.distributed.checkpoint.async_save``: in torch 2.13 it does run in one process without a
process group (it warns and assumes one rank), but it writes DCP's own layout, ``__0_0.distcp`` files plus
a ``.metadata`` index (or, with ``HuggingFaceStorageWriter``, ``model-00001-of-00001.safetensors`` plus
DCP's metadata) of a flattened tensor dict: not ``save_pretrained``'s ``model.safetensors`` with tied
weights written once and a config any Hugging Face tool loads, not the pickled ``trainer_state.pt`` with
the optimizer's param groups, the scheduler and the RNG states, and with no place for our ``hashes.json``
or the tmp-then-rename. Using it would change the checkpoint format and break ``--resume`` of existing
runs, so this module keeps the format and does what ``async_save`` does (stage to host, write on a thread)
with the existing writer.

Deferred snapshots (``AsyncCheckpointer(deferred=True)``, ``checkpoint_snapshot=deferred``): the step pays for
almost nothing. ``save`` takes references to the live tensors (the state dicts share memory with the model and the
optimizer) and copies the small rest (scheduler, RNG, counters); the writer's thread copies the tensors into the
host buffers and then writes. Until that copy is done the weights and optimizer state must not change, and in a
run they change only in an optimizer step: a global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``, torch >= 2.0) makes every ``step`` of every
optimizer wait for it. So the copy overlaps the next step's generation, forward and backward (on the 2-core
CPU the 0.5B-shaped state's 2.35 GB copy takes ~0.18 s; the step it overlaps ~2 s, and ``save`` blocked 0.0007 s,
``tidal bench checkpoint``), and the checkpoint holds the state of the moment ``save`` was called. Not for a
sharded model (its gather is already a copy) or for anything that changes parameters outside an optimizer step
(an elastic replica's heal loads them in place): ``system/validate.py`` refuses those combinations.

What it costs: one extra host copy of the weights and optimizer state (pinned on CUDA), kept for the run;
a snapshot that cannot be allocated falls back to a synchronous save with a warning, never a lost
checkpoint. The background write competes for CPU and memory bandwidth with training; on a GPU the step is
mostly device time and the write hides behind it, on a small CPU machine it shows (docs/benchmarks.md,
``tidal bench checkpoint``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal.train.checkpoint import TrainingState, capture, write_checkpoint
from tidal.train.data_parallel import root_of
from tidal.train.snapshot import HostBuffers, references, snapshot, to_host

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Writes checkpoints in the background, one at a time (see the module docstring)."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._copied: threading.Event | None = None  # set once a deferred snapshot's host copy is complete
        self.buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._began = threading.Event()  # set by the writer thread as it begins: see ``wait``
        self._start_returned = False
        self._error: BaseException | None = None
        self._fallback = False
        self.timings: dict[str, float] = {}
        """The last save's ``wait_s`` (for the previous write), ``snapshot_s`` and, once it finished,
        ``write_s`` and ``write_cpu_s`` (the writer thread's CPU time): what a step paid and what the
        background did."""

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, root: str | Path, model, tokenizer, optimizer, scheduler, state: TrainingState, keep: int = 2,
             components: dict[str, Any] | None = None,
             on_saved: Callable[[Path], None] | None = None) -> Path | None:
        """Snapshot now and write ``root/step_<k>/`` in the background; returns the path it will have (None on
        a data-parallel rank other than 0, which only takes part in the gather). ``on_saved(path)`` runs on
        the writer thread once the checkpoint is complete."""
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        model_state = optimizer_state = None
        if (sharded := root_of(model)) is not None:
            model_state, optimizer_state = sharded.gather_full_state(optimizer)
            if torch.distributed.get_rank() != 0:
                return None
        if self.deferred and sharded is None and not self._fallback:
            return self._save_deferred(root, model, tokenizer, optimizer, scheduler, state, keep, components,
                                       on_saved, start, waited)
        contents = None
        if not self._fallback:
            try:
                contents = snapshot(model, optimizer, scheduler, state, self.buffers, components, model_state,
                                    optimizer_state)
            except (RuntimeError, MemoryError) as e:  # no host memory for the copy: write synchronously
                log.warning("asynchronous checkpoint: the host snapshot could not be allocated (%s); writing "
                            "this and later checkpoints synchronously", " ".join(str(e).split())[:200])
                self._fallback, self.buffers = True, HostBuffers()
        if contents is None:
            contents = capture(model, optimizer, scheduler, state, components, model_state, optimizer_state)
            path = write_checkpoint(root, model, tokenizer, contents, keep)
            if on_saved is not None:
                on_saved(path)
            self.timings = {"wait_s": waited - start, "snapshot_s": 0.0, "write_s": time.perf_counter() - waited}
            return path
        return self._start_writer(root, model, tokenizer, contents, keep, on_saved, state.step, waited - start,
                                  time.perf_counter() - waited)

    def _save_deferred(self, root, model, tokenizer, optimizer, scheduler, state, keep, components, on_saved,
                       start, waited) -> Path:
        """``save`` with the host copy on the writer's thread (module docstring, "Deferred snapshots")."""
        _hold_optimizer_steps()
        refs = references(model, optimizer, scheduler, state, components)
        self._copied = threading.Event()
        with _IN_FLIGHT_LOCK:
            _COPIES_IN_FLIGHT[self._copied] = self
        return self._start_writer(root, model, tokenizer, refs, keep, on_saved, state.step, waited - start,
                                  time.perf_counter() - waited)

    def _start_writer(self, root, model, tokenizer, contents, keep, on_saved, step: int, wait_s: float,
                      snapshot_s: float) -> Path:
        """The writer thread on ``contents`` (a snapshot, or a deferred one's references); the path it writes."""
        self.timings = {"wait_s": wait_s, "snapshot_s": snapshot_s}
        self._began.clear()
        self._start_returned = False
        self._thread = threading.Thread(target=self._write, args=(root, model, tokenizer, contents, keep, on_saved),
                                        name=f"tidal-checkpoint-step_{step}")
        self._thread.start()
        self._start_returned = True
        return Path(root) / f"step_{step}"

    def _write(self, root, model, tokenizer, contents, keep, on_saved) -> None:
        self._began.set()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            if self._copied is not None and not self._copied.is_set():  # a deferred snapshot: copy first
                try:
                    contents = to_host(contents, self.buffers)
                finally:
                    self.timings["copy_s"] = time.perf_counter() - start
                    _copy_done(self._copied)
            path = write_checkpoint(root, model, tokenizer, contents, keep)
            if on_saved is not None:
                on_saved(path)
        except BaseException as e:  # noqa: BLE001  (re-raised on the caller's thread by wait())
            self._error = e
        self.timings["write_s"] = time.perf_counter() - start
        self.timings["write_cpu_s"] = time.thread_time() - cpu  # this thread's CPU: what it can take from training

    def wait(self) -> None:
        """Block until the write in flight (if any) is complete; raise its error if it failed.

        A signal handler that raises inside ``Thread.start`` (SIGTERM during a save) leaves a thread that may
        or may not run: one that began within a second is joined (its checkpoint completes), one that did not
        never will, and ``join`` on it would raise "cannot join thread before it is started". Should a thread that
        began late be missed, ``write_checkpoint``'s lock still keeps two writes from interleaving."""
        thread = self._thread
        if thread is not None and (self._start_returned or self._began.wait(1.0)):
            thread.join()  # an interrupt here keeps the thread: the interrupt's own checkpoint waits for it
        elif self._copied is not None:  # a writer that never ran copies nothing: nothing for a step to wait for
            _copy_done(self._copied)
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait_quietly(self) -> BaseException | None:
        """``wait`` for a run that is already failing: its own error stays the one raised; a write error is
        logged and returned."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001
            log.error("the checkpoint being written when the run stopped failed: %s", e)
            return e
        return None


_COPIES_IN_FLIGHT: dict[threading.Event, AsyncCheckpointer] = {}
"""Deferred snapshots whose host copy is running, and their writers (for ``timings``); an entry leaves when
its copy is done, so a finished writer is not kept alive by the hook below."""
_IN_FLIGHT_LOCK = threading.Lock()


@functools.cache
def _hold_optimizer_steps() -> None:
    """Register, once per process, the optimizer step pre-hook every optimizer runs before it changes anything."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_wait_for_copies)


def _wait_for_copies(optimizer, args, kwargs) -> None:
    """Before any optimizer's step: wait for every deferred snapshot's copy in flight (nothing when none)."""
    if not _COPIES_IN_FLIGHT:
        return
    with _IN_FLIGHT_LOCK:
        pending = list(_COPIES_IN_FLIGHT.items())
    for copied, writer in pending:
        begin = time.perf_counter()
        copied.wait()
        writer.timings["step_wait_s"] = writer.timings.get("step_wait_s", 0.0) + time.perf_counter() - begin


def _copy_done(copied: threading.Event) -> None:
    with _IN_FLIGHT_LOCK:
        _COPIES_IN_FLIGHT.pop(copied, None)
    copied.set()
