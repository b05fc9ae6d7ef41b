"""Peak memory per training step, for the ``perf/peak_mem_gb`` metric.

On CUDA the number is exact and per step: ``torch.cuda.max_memory_allocated`` is the high-water mark of
bytes held by tensors since the last ``reset_peak_memory_stats``, and ``peak_memory`` resets it. It counts
tensors only, not the caching allocator's reserve or the CUDA context.

On CPU torch keeps no such counter, so the number is the process's peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``). That is process-wide (Python, libraries, the rollout
engine if it shares the process) and monotonic: it can never be reset, and a step that stays below an
earlier high-water mark reports the same value. What tells you a step needed more memory is the growth
of the high-water mark, ``perf/peak_mem_growth_gb``; ``PeakMemory`` reports both, with the same meaning on
CUDA (growth of the running maximum of per-step peaks), so a curve reads the same on either device.

``tensor_peak_bytes(fn)`` is the measuring tape for tests and docs: the peak of bytes held by tensors
allocated while ``fn`` runs, replayed from the PyTorch profiler's allocation events. Unlike RSS it sees
every allocation and free exactly (the CPU allocator does not cache, and malloc's own reuse does not
blur it), so it is deterministic for a given sequence of ops; it slows ``fn`` down, so it is not for
the training loop.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

GB = 1e9


def peak_memory(reset: bool = True) -> int:
    """Peak bytes: on CUDA, allocated by tensors since the last reset (then reset, if ``reset``); on CPU,
    the process's peak resident set size so far (monotonic; ``reset`` has nothing to reset)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux reports KiB, macOS bytes


class PeakMemory:
    """Call ``step_metrics()`` once per training step (after the optimizer step) for that step's peak and
    how far it raised the run's high-water mark. Construct it before the first step: the high-water mark
    starts at what the process already holds (the model, the data)."""

    def __init__(self) -> None:
        self._high = peak_memory(reset=True)

    def step_metrics(self) -> dict[str, float]:
        peak = peak_memory(reset=True)
        growth = max(0, peak - self._high)
        self._high = max(self._high, peak)
        return {"perf/peak_mem_gb": peak / GB, "perf/peak_mem_growth_gb": growth / GB}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (AdamW: two moments; LoRA: the adapters' only)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def tensor_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of (bytes allocated - bytes freed) by torch, on all devices together, while ``fn()`` runs,
    counted from zero at the start; tensors that existed before and are freed inside count negative."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    # The raw events: prof.events() folds allocations into the op that made them and keeps only frees.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
