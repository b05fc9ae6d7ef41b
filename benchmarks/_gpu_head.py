"""``tidal bench gpu``'s ``head_kernel`` part: the trainer's LM head (float32 matmul, log-softmax, target log-prob,
entropy) forward + backward under each ``trainer.head_kernel`` (``models/logprobs.py``: ``chunked``, the
checkpointed chunks; ``fused``, one autograd Function with a closed-form backward; ``compiled``, the same with its
elementwise work under ``torch.compile``), on one micro-batch's tokens at the bench model's shapes (Qwen2.5-0.5B's
vocabulary 151,936 x hidden 896 on CUDA, ``micro_batch_tokens`` tokens, chunks of the trainer's default 1,024).

Per kernel and head matmul precision (``fp32``; ``tf32`` too on CUDA): the median fwd+bwd milliseconds over
``REPS`` calls after one warm-up (``compile_s``: the warm-up's time, which holds ``torch.compile``'s), the peak
memory the call adds above its inputs (CUDA's allocator; None on a CPU), the matmul FLOPs it ran (``chunked`` 4
matmuls of 2 x tokens x hidden x vocab per chunk, ``fused``/``compiled`` 3 on the last chunk:
tests/models/test_head_kernel.py counts them) and its largest difference from ``chunked`` in log-probs and in the
gradients (relative to the largest gradient): the device's own equality check. The loss is a random per-token
weighting of the log-probs; the entropy is computed without a gradient, as the trainer's metric is.
``head_kernel_speedup`` is ``chunked``'s ms over each kernel's. Issue 51: whichever measures faster becomes the
default once a device run confirms it."""

from __future__ import annotations

import statistics
import time

import torch

REPS = 3
KERNELS = ("chunked", "fused", "compiled")


def head_inputs(vocab: int, hidden: int, tokens: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden_1nh = (torch.randn(1, tokens, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_(True)
    weight_vh = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g).to(device) * 0.02)
    targets_1n = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    upstream_1n = torch.randn(1, tokens, generator=g).to(device)
    return hidden_1nh, weight_vh, targets_1n, upstream_1n


def head_step(kernel: str, tf32: bool, inputs, chunk_size: int, temperature: float = 1.0):
    """One forward + backward of the head; returns (log-probs, hidden's gradient, weight's gradient)."""
    from tidal.models.logprobs import chunked_head_logprobs

    hidden_1nh, weight_vh, targets_1n, upstream_1n = inputs
    hidden_1nh.grad = weight_vh.grad = None
    logp, _ = chunked_head_logprobs(hidden_1nh, weight_vh, None, targets_1n, temperature, True, chunk_size, False,
                                    tf32, kernel=kernel)
    (logp * upstream_1n).sum().backward()
    return logp.detach(), hidden_1nh.grad, weight_vh.grad


def matmul_flops(kernel: str, tokens: int, hidden: int, vocab: int, chunk_size: int) -> float:
    """The head matmuls' FLOPs of one forward + backward (module docstring)."""
    last = tokens - (tokens - 1) // chunk_size * chunk_size
    matmul_rows = 4 * tokens - (0 if kernel == "chunked" else last)
    return 2.0 * matmul_rows * hidden * vocab


def measure(vocab: int, hidden: int, tokens: int, chunk_size: int, device: torch.device,
            kernels=KERNELS, reps: int = REPS) -> dict:
    """``{"<kernel> <fp32|tf32>": {...}}`` and the speedups (module docstring)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    inputs = head_inputs(vocab, hidden, tokens, device)
    arms: dict = {}
    reference: dict = {}
    for tf32 in ([False, True] if device.type == "cuda" else [False]):
        for kernel in kernels:
            name = f"{kernel} {'tf32' if tf32 else 'fp32'}"
            try:
                sync()
                start = time.perf_counter()
                logp, grad_h, grad_w = head_step(kernel, tf32, inputs, chunk_size)
                sync()
                warm_s = time.perf_counter() - start
                if kernel == "chunked":
                    reference[tf32] = (logp, grad_h.clone(), grad_w.clone())
                    diffs = {}
                else:
                    ref = reference.get(tf32)
                    diffs = {} if ref is None else {
                        "max_abs_logp_diff": (logp - ref[0]).abs().max().item(),
                        "max_rel_grad_hidden_diff": ((grad_h - ref[1]).abs().max() / ref[1].abs().max()).item(),
                        "max_rel_grad_weight_diff": ((grad_w - ref[2]).abs().max() / ref[2].abs().max()).item()}
                del logp, grad_h, grad_w
                times = []
                peak_mib = None
                for _ in range(reps):
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        before = torch.cuda.memory_allocated(device)
                    sync()
                    start = time.perf_counter()
                    head_step(kernel, tf32, inputs, chunk_size)
                    sync()
                    times.append(time.perf_counter() - start)
                    if device.type == "cuda":
                        peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
                ms = 1e3 * statistics.median(times)
                flops = matmul_flops(kernel, tokens, hidden, vocab, chunk_size)
                arms[name] = {"ms": ms, "times_ms": [1e3 * t for t in times], "warmup_s": warm_s,
                              "compile_s": warm_s if kernel == "compiled" else None, "peak_mib_above_inputs": peak_mib,
                              "matmul_flops": flops, "matmul_tflops_per_s": flops / (ms / 1e3) / 1e12, **diffs}
            except Exception as e:  # noqa: BLE001 (one kernel failing, e.g. no compiler, is itself the answer)
                arms[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[bench gpu] head_kernel {name}: {arms[name].get('ms', arms[name].get('error'))}", flush=True)
    speedup = {name: arms[f"chunked {name.split()[1]}"]["ms"] / arm["ms"] for name, arm in arms.items()
               if "ms" in arm and "ms" in arms.get(f"chunked {name.split()[1]}", {})}
    return {"head_kernel_arms": arms, "head_kernel_speedup": speedup,
            "head_shape": {"vocab": vocab, "hidden": hidden, "tokens": tokens, "chunk_size": chunk_size}}


def part_head_kernel(s, base: torch.nn.Module, device: torch.device, peaks: dict) -> dict:
    """The ``head_kernel`` part of ``benchmarks/gpu.py``: the bench model's head shape on ``micro_batch_tokens``
    tokens (module docstring)."""
    from tidal.models.logprobs import DEFAULT_CHUNK_SIZE

    config = base.config
    chunk = min(DEFAULT_CHUNK_SIZE, max(8, s.micro_batch_tokens // 4))  # tiny runs still cut several chunks
    return measure(config.vocab_size, config.hidden_size, s.micro_batch_tokens, chunk, device)
