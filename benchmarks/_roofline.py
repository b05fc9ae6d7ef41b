"""The accounting behind ``tidal bench gpu``'s MFU and roofline figures: model FLOPs, decode bytes, device
peaks (datasheet and measured), synchronized timing, and the time budget that stops a part (``within``). The
formulas and their sources are in ``gpu.py``'s docstring (parts 1 and 2); ``tests/test_bench_gpu.py`` checks each
against hand-computed numbers."""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

DATASHEET_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                         ("H200", 989.0), ("A100", 312.0)]
"""Dense BF16 tensor-core peaks by device-name substring, first match wins (NVIDIA's H100/H200 datasheets
list 1,979 TFLOP/s for SXM "with sparsity", twice the dense rate; the A100's is 312 dense). The SXM H100
calls itself "NVIDIA H100 80GB HBM3"."""


def matmul_params(model: torch.nn.Module) -> int:
    """N: every parameter outside the input embedding, plus the LM head's weight (counted even when tied to the
    embedding: the head's matmul runs on every token either way)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rest = sum(p.numel() for p in model.parameters() if p is not emb and p is not head)
    return rest + head.numel()


def training_flops(num_params: int, num_layers: int, attn_dim: int, lengths: list[int], head_params: int = 0,
                   head_tokens: int | None = None) -> float:
    """Model FLOPs of one forward + backward over packed sequences of ``lengths`` (module docstring, part 1):
    6 N per token plus 12 * layers * d_attn per attended (query, key) pair, L (L + 1) / 2 pairs per sequence.
    ``head_tokens``: the tokens the LM head (``head_params`` of N) actually computes, when it skips some
    (``trainer.head_tokens=loss``): its 6 x head_params FLOPs are counted for those tokens only (issue 51:
    honest MFU counts the head's work that ran)."""
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    head_tokens = tokens if head_tokens is None else head_tokens
    matmuls = (num_params - head_params) * tokens + head_params * head_tokens
    return 6.0 * matmuls + 12.0 * num_layers * attn_dim * pairs


def decode_steps(prompt_lens: list[int], budgets: list[int], max_rows: int) -> list[tuple[int, int]]:
    """The engine's decode schedule as (live rows, total context tokens of those rows) per step: requests join
    in order while fewer than ``max_rows`` run, each live row makes one token per step and leaves after its
    budget (its slot is free at the next step). A row's context is its prompt plus its tokens so far."""
    pending = deque(zip(prompt_lens, budgets))
    live: list[list[int]] = []  # [context, tokens left]
    steps = []
    while pending or live:
        while pending and len(live) < max_rows:
            live.append(list(pending.popleft()))
        steps.append((len(live), sum(ctx for ctx, _ in live)))
        live = [[ctx + 1, left - 1] for ctx, left in live if left > 1]
    return steps


def roofline_tokens_per_s(weight_bytes: float, kv_bytes_per_token: float, steps: list[tuple[int, int]],
                          bandwidth: float) -> float:
    """Tokens/s if every decode step only moved its bytes at ``bandwidth`` (bytes/s): each step reads all weights
    once plus every live row's keys and values (module docstring, part 2)."""
    seconds = sum(weight_bytes + kv_bytes_per_token * context for _, context in steps) / bandwidth
    return sum(rows for rows, _ in steps) / seconds


def datasheet_tflops(name: str) -> float | None:
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS if key in name), None)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


# ---- measuring -------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device):
    """(fn(), seconds), with the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def profile_table(fn: Callable, device: torch.device, top: int = 20) -> list[dict]:
    """The ``top`` operations of one ``fn()`` by self device time (host time on a CPU), with call counts."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key[:80], "calls": e.count, "self_device_ms": device_us / 1e3,
                     "self_host_ms": e.self_cpu_time_total / 1e3})
    key = "self_device_ms" if device.type == "cuda" else "self_host_ms"
    return sorted(rows, key=lambda r: -r[key])[:top]


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5, per_sample: int = 10) -> float:
    """Median TFLOP/s of ``per_sample`` back-to-back n x n x n matmuls (2 n^3 FLOPs each), ``repeats`` samples."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up (library handles, kernel selection)

    def burst():
        for _ in range(per_sample):
            a @ b

    return statistics.median(2 * n**3 * per_sample / timed(burst, device)[1] / 1e12 for _ in range(repeats))


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Median bytes/s of a device-to-device ``copy_``, counting bytes read plus bytes written."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(2 * src.numel() / timed(lambda: dst.copy_(src), device)[1] for _ in range(repeats))


class BudgetSpent(Exception):
    """The bench's ``budget_s`` ran out inside a part (``within``)."""


@contextlib.contextmanager
def within(seconds: float | None):
    """Raise ``BudgetSpent`` in the main thread once ``seconds`` pass (SIGALRM; None or another thread: no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def spent(signum, frame):
        raise BudgetSpent(f"stopped after {seconds:.0f} s: the bench's budget_s was spent inside this part")

    previous = signal.signal(signal.SIGALRM, spent)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
