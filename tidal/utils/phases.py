"""Where a trainer step's time goes: its forward passes, the LM head within them, the backward passes and the
optimizer (issue 51's instruments), logged as ``perf/trainer_<phase>_ms``.

On CUDA each phase is bracketed by CUDA events on the current stream, so the times are the device's and
recording them never waits for it; the events are read once, after the step. Elsewhere (CPU) work runs as it is
issued, and ``time.perf_counter`` around it measures the same thing; docs/metrics.md says which clock.

The trainer opens a ``PhaseTimer`` around its step; code below it (``models/logprobs.py``'s head) marks its
part with ``phase(name)``, a no-op when no timer is open (a rollout engine scoring, an evaluation).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

import torch

PHASES = ("forward", "head", "backward", "optimizer")
_CURRENT: contextvars.ContextVar[PhaseTimer | None] = contextvars.ContextVar("tidal_phase_timer", default=None)


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []  # (phase, start, end): events or perf_counter values
        self._open: list[str] = []
        self._token: contextvars.Token | None = None

    def __enter__(self) -> PhaseTimer:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name``. The head's recompute inside a backward (``torch.utils.checkpoint``) is
        the backward's: ``head`` counts forward work only."""
        assert name in PHASES, name
        if name == "head" and "backward" in self._open:
            yield
            return
        self._open.append(name)
        try:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
            else:
                start = time.perf_counter()
                yield
                end = time.perf_counter()
            self._marks.append((name, start, end))
        finally:
            self._open.pop()

    def read(self) -> dict[str, float]:
        """Milliseconds per phase, summed over the step (one wait for the device, on CUDA)."""
        totals = dict.fromkeys(PHASES, 0.0)
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()  # the last event recorded: every earlier one is done too
        for name, start, end in self._marks:
            totals[name] += start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        return {f"perf/trainer_{name}_ms": ms for name, ms in totals.items()}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """``PhaseTimer.phase`` of the timer open in this context; nothing without one."""
    timer = _CURRENT.get()
    if timer is None:
        yield
        return
    with timer.phase(name):
        yield
