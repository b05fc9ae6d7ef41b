"""The cost model: what one decode step, a prefill, a training step and a weight sync cost, and on
how many devices each phase runs.

One engine instance (a CPU process with its threads, or an SGLang/vLLM server on ``engine_devices``
GPUs) advances all of its running sequences by one token per decode step. With n running sequences
holding C context tokens in total (prompt + tokens so far), a step takes

    t_decode(n, C) = (decode_step_s + decode_per_seq_s * n + decode_per_ctx_token_s * C) / speed

- ``decode_step_s`` is what a step costs however few rows run: reading every weight once, kernel
  launches, Python. It is why decoding is memory-bound at small batch, and why a synchronous step
  that waits for its longest response runs its tail at a poor tokens/s (AReaL, arXiv 2505.24298,
  sec. 3: "generation becomes memory-IO bound").
- ``decode_per_seq_s`` is the per-row compute (matmuls, sampling), ``decode_per_ctx_token_s`` the
  attention's read of the KV cache (it matters at long context: 28 KB per token for a 1.5B Qwen2).

A prefill (admitting a prompt, or re-reading a sequence after a weight update interrupted it) costs
``prefill_per_token_s`` per token. A training step on B sequences costs

    t_train = (train_step_s + train_per_token_s * tokens + train_per_token_ctx_s * sum(len^2) / 2) / speed

where ``tokens`` counts prompt + response tokens (or rows x the longest row when ``train_padded``:
a padded batch pays for its padding, as tidal's CPU trainer does without packing), and the last term
is causal attention. ``speed`` is ``devices ** scaling``: 1.0 is perfect scaling (data parallel
GPUs), less than 1 is what threads on shared cores give (measured by the CPU calibration).
Weight sync costs ``weight_sync_s`` on the trainer (publishing blocks its next step) and
``weight_load_s`` on each engine when it applies the update; a reward arrives ``reward_s`` after a
group's last token (the verifier runs on CPUs beside the devices: latency, not device time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class CostModel:
    """Per-operation costs at speed 1 (one device, or one engine instance). Seconds."""

    decode_step_s: float = 1e-3
    """Fixed cost of one decode step of one engine, whatever its batch (weights read, launches)."""
    decode_per_seq_s: float = 0.0
    """Extra decode-step time per running sequence."""
    decode_per_ctx_token_s: float = 0.0
    """Extra decode-step time per context token held by the running sequences (KV-cache read)."""
    prefill_per_token_s: float = 0.0
    """Prefill time per token: new prompts (one per group: its samples share it) and re-prefills."""
    train_step_s: float = 0.0
    """Fixed time of one training step (optimizer, batch building, bookkeeping)."""
    train_per_token_s: float = 0.0
    """Training time per token (forward, backward, log-prob recomputation) on one device."""
    train_per_token_ctx_s: float = 0.0
    """Causal-attention training time per (token, earlier token) pair on one device."""
    train_padded: bool = False
    """Count rows x longest row as the trained tokens (one padded batch) instead of real tokens."""
    weight_sync_s: float = 0.0
    """Trainer-side cost of publishing new weights (blocks the trainer)."""
    weight_load_s: float = 0.0
    """Engine-side cost of loading new weights (blocks that engine)."""
    reward_s: float = 0.0
    """Latency from a group's last token to its reward (CPU-side verifier)."""
    gen_scaling: float = 1.0
    """Generation speed on k devices of one engine is k ** gen_scaling (threads: measured)."""
    train_scaling: float = 1.0
    """Training speed on k devices is k ** train_scaling (1: perfect data-parallel scaling)."""
    overlap_gen_slowdown: float = 1.0
    """Shared pool only: decode time multiplier while training runs at the same time (CPU: the GIL
    and memory bandwidth are shared; measured by the calibration)."""
    overlap_train_slowdown: float = 1.0
    """Shared pool only: training time multiplier while generation runs at the same time."""
    measured: dict[int, dict[str, float]] = field(default_factory=dict)
    """Decode and prefill costs measured on exactly k devices of one engine (CPU threads):
    ``{k: {"decode_step_s": ..., ...}}``. An engine on k devices uses them at speed 1 instead of the
    scaling law, which holds only where it was fitted: on CPU, a second thread halves the per-row
    work but not the fixed per-step cost, so one exponent cannot describe both a 128-row step and
    the few-row tail of a long-tailed batch."""


@dataclass
class Layout:
    """Which devices do what. Async and periodic modes split the pool: ``gen_devices`` generate, the
    rest train. Sync either gives each phase the whole pool in turn (``sync_colocated``, what
    synchronous systems such as verl and synchronous AReaL do) or keeps the same split."""

    devices: int = 1
    """Devices in the pool (GPUs, or CPU cores)."""
    gen_devices: int = 1
    """Generation devices in async and periodic modes; ``devices - gen_devices`` train."""
    engine_devices: int = 0
    """Devices per engine instance (its tensor-parallel size); generation runs
    ``gen_devices // engine_devices`` engines, each at speed 1. 0: one engine spanning every
    generation device (CPU threads), at speed ``gen_devices ** gen_scaling``."""
    max_batch: int = 512
    """Most sequences one engine decodes at once (slots; KV-cache capacity on a GPU)."""
    sync_colocated: bool = True
    """Sync mode: generation and training each use all ``devices``, taking turns."""
    shared_pool: bool = False
    """Generation and training share one process's cores (tidal's CPU async): the overlap
    slowdowns apply while both run, and a generator blocked on the staleness bound with nothing to
    decode lends its cores to the trainer (``SystemConfig.async_threads``)."""


def device_speed(devices: float, scaling: float) -> float:
    """Speed of a phase on ``devices`` devices relative to one: devices ** scaling."""
    assert devices > 0, "a phase needs at least one device"
    return float(devices) ** scaling


def engine_costs(c: CostModel, devices: int) -> tuple[CostModel, float]:
    """The costs and speed of one engine spanning ``devices`` devices: measured costs where
    ``c.measured`` has that device count, else the speed-1 costs at ``devices ** gen_scaling``."""
    if devices in c.measured:
        return replace(c, **c.measured[devices]), 1.0
    return c, device_speed(devices, c.gen_scaling)


def decode_time(c: CostModel, n: int, ctx: float, steps: int, speed: float) -> float:
    """Time of ``steps`` decode steps of n rows holding ``ctx`` context tokens at the first step; each
    step adds n tokens of context: sum_i (a + b n + c (ctx + n i)) / speed."""
    per_step = c.decode_step_s + c.decode_per_seq_s * n + c.decode_per_ctx_token_s * ctx
    return (steps * per_step + c.decode_per_ctx_token_s * n * steps * (steps - 1) / 2) / speed


def steps_until(c: CostModel, n: int, ctx: float, dt: float, speed: float, max_steps: int) -> int:
    """The fewest whole steps whose total time reaches ``dt`` (an event at dt lands on the step
    boundary at or after it), at most ``max_steps``. Binary search: decode_time grows with steps."""
    if dt <= 0:
        return 0
    lo, hi = 0, max_steps
    if decode_time(c, n, ctx, hi, speed) < dt:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_time(c, n, ctx, mid, speed) >= dt:
            hi = mid
        else:
            lo = mid + 1
    return lo


def train_time(c: CostModel, seq_lens: list[int], speed: float) -> float:
    """One training step on sequences of ``seq_lens`` tokens (prompt + response)."""
    if not seq_lens:
        return c.train_step_s / speed
    tokens = len(seq_lens) * max(seq_lens) if c.train_padded else sum(seq_lens)
    pairs = sum(n * n for n in seq_lens) / 2
    return (c.train_step_s + c.train_per_token_s * tokens + c.train_per_token_ctx_s * pairs) / speed
