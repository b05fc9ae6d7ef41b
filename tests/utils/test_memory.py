"""peak_memory / PeakMemory: per-step peaks and high-water-mark growth on CPU (RSS) and CUDA (both mocked,
plus one real RSS check); tensor_peak_bytes: exact on known allocations."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal.utils import memory
from tidal.utils.memory import PeakMemory, peak_memory, tensor_peak_bytes


def test_tensor_peak_bytes_replays_allocations_and_frees():
    def two_live_then_one():
        x = torch.empty(1 << 20)  # 4 MiB
        y = torch.empty(1 << 20)
        del x
        z = torch.empty(1 << 20)
        return y, z

    assert tensor_peak_bytes(two_live_then_one) == 8 << 20


def test_cpu_reports_the_monotonic_rss_high_water_mark_and_its_growth(monkeypatch):
    maxrss_kib = iter([400_000, 400_000, 700_000, 700_000])  # what ru_maxrss would say, step by step
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory.sys, "platform", "linux")
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=next(maxrss_kib)))
    meter = PeakMemory()
    rows = [meter.step_metrics() for _ in range(3)]
    assert [r["perf/peak_mem_gb"] for r in rows] == [0.4096, 0.7168, 0.7168]
    assert [round(r["perf/peak_mem_growth_gb"], 6) for r in rows] == [0.0, 0.3072, 0.0]


def test_the_real_cpu_peak_is_at_least_the_current_resident_set():
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if torch.cuda.is_available():
        pytest.skip("on CUDA peak_memory reports the device, not the process")
    # Within 5%: the kernel updates its RSS counters in batches, so the two readings can differ slightly.
    assert isinstance(peak_memory(reset=False), int) and peak_memory(reset=False) >= 0.95 * rss


def test_cuda_peaks_are_per_step_and_reset(monkeypatch):
    peaks, resets = iter([100, 300, 200, 500]), []
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory.torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(memory.torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    meter = PeakMemory()  # baseline 100
    rows = [meter.step_metrics() for _ in range(3)]
    assert [r["perf/peak_mem_gb"] * 1e9 for r in rows] == [300, 200, 500]
    assert [r["perf/peak_mem_growth_gb"] * 1e9 for r in rows] == [200, 0, 200]
    assert len(resets) == 4
