"""Static-shape decode steps for the slot cache, replayed from CUDA graphs on a GPU.

Why: a decode step of a small model is launch-bound. Each of the model's ~15 kernels per layer is queued by
Python (Hugging Face's modules, our cache), so on a GPU the step costs what the host takes to issue them,
not what the GPU takes to run them: the first device check measured about 80 ms per step for a 0.5B model
at 256 rows (``benchmarks/results/gpu/``), where reading the weights and the KV cache once takes under
1 ms. A CUDA graph records the step's kernels once and replays them with one launch (the lever vLLM and
SGLang use for decode; PyTorch: ``torch.cuda.CUDAGraph``).

A graph replays fixed shapes and fixed memory, so the step is rewritten with static shapes:

- The running rows are padded up to a *bucket* (1, 2, 4, ... ``max_slots``), one graph per bucket; padding
  rows run on free slots and are ignored.
- Attention reads the first W columns of the slot buffers, ``[0, W)``, instead of the live span; the mask
  admits a row's own columns ``[start, t]``. Masked columns weigh exactly 0, so the result is the dynamic
  step's up to summation order (tests compare them on the CPU, where the same static step runs eagerly).
  ``rollout.graph_widths``: with ``full`` W is the buffer width ``columns``; with ``buckets`` W is the write
  column's *width bucket* (``width_bucket``: the smallest power of two >= t + 1, at least ``MIN_WIDTH``, capped at
  ``columns``), see "Width buckets" below.
- The new column ``t`` is written with ``index_copy_`` at a device index, so replays follow ``t``; an MoE
  model's expert ids too (``_BucketCache.write_routes``: the router hook runs while the graph is recorded).
- A model with sliding-window layers takes one static mask buffer per layer type (``SlotCache.attention_mask``
  builds them; the positions count a row's live columns over the whole width).

Width buckets (``rollout.graph_widths=buckets``, issue 51). The slot cache is sized once per call for the prompt
plus the whole length budget (``sizing.py``), so with ``full`` a 4k-token budget makes every early step read ~4k
columns per row (keys and values, every layer) where only the prompt and the first tokens are live: attention
traffic grows with the budget, not with the context. Every running row's live columns lie in ``[0, t]``
(``start >= 0``: a row joins with ``start = t - length``, ``t`` at least its prefill's width, and moves and
compaction shift ``start`` and ``lo`` alike to a ``dst >= 0``; ``t + 1 <= columns``: ``SlotCache._place(0, extra=1)``
runs before every step), so the first W >= t + 1 columns hold all a step needs, and the static step attends to
views ``keys[layer][:rows, :, :W]``: the same strides as the whole buffer's (the last dimension contiguous, as
SDPA's fused kernels need), only a shorter third dimension. Each (rows, W) step has its own static mask buffer
[rows, 1, 1, W] (contiguous: no strided mask reaches a kernel), and its own graph. Positions are each row's live
columns counted as before (the windows' count is a cumulative sum over ``[0, W)``, equal to one over the whole
width since every column > t is dead). Powers of two, not multiples of a quantum: a step reads at most twice
its live width (t + 1), and a call needs log2(columns / ``MIN_WIDTH``) + 1 widths per rows bucket (8 at 4,352
columns), where a 256-column quantum would need 17 recordings per rows bucket for at most 255 columns saved per
step. ``MIN_WIDTH`` (64): a narrower bucket saves at most 63 columns a step and costs a recording each. The slot
cache keeps the live span near column 0 so that W follows the context, not where the span happens to sit: with
width buckets a span that would fit a smaller bucket at the left edge is moved there (``SlotCache._place``), a
copy of the span paid back within a few steps (each later step reads >= span + 1 fewer columns).

Graphs are recorded per (rows bucket, width bucket, buffer), all of a call's buckets at once when the slot cache
is sized (``prepare``, from ``SlotCache.reserve`` before the call's first row joins; one garbage collection for
all of them; with width buckets every width from the call's shortest prompt's up to ``columns``, counted in
``rollout/graph_recordings``): recording mid-decode made an H200 RL step's first generate take 4.12 s against
2.06 s for the second (issue 51). When the slot cache reallocates its buffers (more rows or columns) the recorded
graphs are dropped; a bucket decode meets unrecorded is recorded then (``num_late``: the fallback, counted). If
recording fails (a model whose forward synchronizes with the host, say) the engine says so once and decodes eagerly.
Rows that share a context (``SamplingConfig.share_identical_rows``) need a gather the graph cannot hold, so
with graphs every row is decoded (the step is cheap; sharing saved work at the tiny model's scale).
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache

log = logging.getLogger(__name__)

GRAPH_WIDTHS = ("full", "buckets")
"""``rollout.graph_widths``: ``full`` attends over every buffer column each step (the default until a GPU measures
``buckets``); ``buckets`` over the write column's width bucket (module docstring)."""
MIN_WIDTH = 64
"""The narrowest width bucket (module docstring)."""


class _BucketCache(Cache):
    """The slot buffers' first ``rows`` slots as a Hugging Face cache: ``update`` writes column ``t_index`` in
    place and hands attention the buffers' first ``width`` columns (static shapes; views, no copy)."""

    def __init__(self, slots, rows: int, t_index: torch.Tensor, width: int):
        super().__init__(layers=[])
        self.slots, self.rows, self.t_index, self.width = slots, rows, t_index, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k = self.slots.keys[layer_idx][: self.rows, :, : self.width]
        v = self.slots.values[layer_idx][: self.rows, :, : self.width]
        k.index_copy_(2, self.t_index, key_states)
        v.index_copy_(2, self.t_index, value_states)
        return k, v

    def write_routes(self, layer: int, ids_nk: torch.Tensor) -> None:
        """An MoE model's routers' sink (``routes.py``): each row's expert ids at column ``t_index``, in the graph."""
        routes = self.slots.routes[layer, : self.rows]
        routes.index_copy_(1, self.t_index, ids_nk.view(self.rows, 1, -1).to(routes.dtype))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # no host-side value may depend on the step: position ids and the mask carry everything


def _copy_masks(dst, src) -> None:
    """Copy a step's mask (one tensor, or one per layer type) into its static buffers."""
    if isinstance(dst, dict):
        for kind, mask in dst.items():
            mask.copy_(src[kind])
    else:
        dst.copy_(src)


def bucket(n: int, max_rows: int) -> int:
    """The smallest power of two >= n, capped at ``max_rows``."""
    return min(max_rows, 1 << max(0, n - 1).bit_length())


def width_bucket(n: int, columns: int) -> int:
    """The smallest power of two >= n and >= ``MIN_WIDTH``, capped at ``columns``."""
    return min(columns, max(MIN_WIDTH, 1 << max(0, n - 1).bit_length()))


def width_buckets(shortest: int, columns: int) -> list[int]:
    """Every width bucket a step whose write column is at least ``shortest`` can meet in ``columns`` columns."""
    widths = [width_bucket(shortest + 1, columns)]
    while widths[-1] < columns:
        widths.append(min(columns, 2 * widths[-1]))
    return widths


@dataclass
class _Step:
    """One bucket's static inputs, its eager forward, and (on CUDA) its recorded graph and output."""

    tokens: torch.Tensor  # long [rows, 1]
    pos: torch.Tensor  # long [rows, 1]
    mask: torch.Tensor | dict[str, torch.Tensor]  # bool [rows, 1, 1, width], or one per layer type (windows)
    t_index: torch.Tensor  # long [1]: the column this step writes
    cache: _BucketCache
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the graph's logits [rows, V]


class StaticDecoder:
    """One decode step over slots [0, rows bucket) and columns [0, width) with static shapes; on CUDA recorded once
    per (rows, width) bucket as a CUDA graph and replayed (``capture``), elsewhere run eagerly (the same
    computation, for tests)."""

    def __init__(self, forward: Callable[..., torch.Tensor], slots, capture: bool, widths: str = "full"):
        """``forward(input_ids, attention_mask, position_ids, cache) -> logits [rows, V]``: the model's decode
        forward (``SlotCache.use_static_decode`` builds it); ``widths``: ``rollout.graph_widths``."""
        if widths not in GRAPH_WIDTHS:
            raise ValueError(f"rollout.graph_widths={widths!r}: one of {', '.join(GRAPH_WIDTHS)}")
        self.buckets = widths == "buckets"
        # A weak reference: the slot cache owns this decoder, and a cycle between them would leave an old engine's
        # graphs to the garbage collector, which may free them in the middle of a later recording.
        self.forward, self.slots = forward, weakref.proxy(slots)
        self.capture = capture and slots.device.type == "cuda"
        self._steps: dict[tuple[int, int], _Step] = {}  # by (rows, width)
        self._shortest: int | None = None  # the shortest write column ``prepare`` was told of, this allocation
        self._generation = -1
        self._pool = None
        self.failed = False
        self.num_recorded = 0
        self.record_seconds = 0.0  # host wall-clock time of the recordings, warm-ups included (engine metrics)
        self.num_built = 0  # steps built (recorded on CUDA, eager elsewhere), ``prepare``'s and decode's
        self.num_late = 0  # of those, built by ``decode`` (a bucket ``prepare`` had not built): mid-decode work

    def decode(self, tokens_n: torch.Tensor, pos_n: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of the running rows after feeding ``tokens_n`` at position ids ``pos_n``; writes each
        row's new keys and values at column ``slots.t``."""
        s = self.slots
        n, rows = s.n, bucket(s.n, len(s.start))
        width = width_bucket(s.t + 1, s.columns) if self.buckets else s.columns
        self._follow_buffers()
        step = self._steps.get((rows, width))
        if step is None:
            self.num_late += 1
            step = self._build([(rows, width)])[0]
        step.tokens[:n, 0] = tokens_n
        step.tokens[n:] = 0
        step.pos[:n, 0] = pos_n
        step.pos[n:] = 0
        step.t_index.fill_(s.t)
        cols = torch.arange(width, device=s.device)
        start = torch.full((rows,), s.t, dtype=torch.long, device=s.device)  # padding rows see column t only
        start[:n] = s.start[:n]
        live = (cols >= start[:, None]) & (cols <= s.t)
        if s.has_rejected:  # speculative decoding's rolled-back drafts (``slots.py``)
            live[:n] &= ~s.rejected[:n, :width]
        _copy_masks(step.mask, s.attention_mask(live[:, None, None, :], live, step.pos))
        if step.graph is None:
            return self._run(step)[:n]
        step.graph.replay()
        return step.out[:n]

    def prepare(self, max_rows: int, shortest: int = 0) -> None:
        """Build (on CUDA: record) the step of every bucket a batch of up to ``max_rows`` running rows meets as its
        rows finish, each once per buffer allocation: a second call of the same shape builds nothing. With width
        buckets, every width from the one of write column ``shortest`` (the call's shortest prompt: a step's write
        column is at least its rows' context) up to ``columns``, for each rows bucket."""
        self._follow_buffers()
        s = self.slots
        cap = len(s.start)
        if self.buckets:  # never narrower than this allocation's earlier calls asked for: those steps exist already
            self._shortest = shortest if self._shortest is None else min(self._shortest, shortest)
            widths = width_buckets(self._shortest, s.columns)
        else:
            widths = [s.columns]
        wanted = sorted({(bucket(n, cap), w) for n in range(1, max_rows + 1) for w in widths} - self._steps.keys())
        if wanted:
            self._build(wanted)

    def _follow_buffers(self) -> None:
        if self._generation != self.slots.generation:  # reallocated buffers: recorded graphs point at freed memory
            self._steps.clear()
            self._shortest = None
            self._generation = self.slots.generation

    def _build(self, buckets: list[tuple[int, int]]) -> list[_Step]:
        """The steps of (rows, width) ``buckets``, each with its own static inputs (its mask ``width`` columns wide)."""
        s = self.slots
        steps = []
        for rows, width in buckets:
            t_index = torch.zeros(1, dtype=torch.long, device=s.device)
            steps.append(_Step(tokens=torch.zeros(rows, 1, dtype=torch.long, device=s.device),
                               pos=torch.zeros(rows, 1, dtype=torch.long, device=s.device),
                               mask=s.layout.build(lambda _, rows=rows, width=width: torch.zeros(
                                   rows, 1, 1, width, dtype=torch.bool, device=s.device)),
                               t_index=t_index, cache=_BucketCache(s, rows, t_index, width)))
        if self.capture and not self.failed:
            try:
                self._record(steps)
            except Exception as e:  # noqa: BLE001 (fall back to eager decoding, said once)
                self.failed = True
                for step in steps:
                    if step.graph is not None:
                        step.graph.reset()
                    step.graph = step.out = None
                log.warning("CUDA graph recording failed (%s: %s); decoding without graphs", type(e).__name__, e)
        for key, step in zip(buckets, steps):
            self._steps[key] = step
        self.num_built += len(steps)
        return steps

    def _run(self, step: _Step) -> torch.Tensor:
        """The bucket's forward (no closures: nothing here may hold a cycle that keeps graphs alive)."""
        return self.forward(step.tokens, step.mask, step.pos, step.cache)

    def _record(self, steps: list[_Step]) -> None:
        """Warm up on a side stream (as ``torch.cuda.graphs`` requires), then record each step, with one garbage
        collection for all of them. The warm-ups write column c = min(t, width - 1) of rows [0, bucket) (a recording
        runs nothing): column t is the running rows' next, but a width bucket recorded ahead may end left of t, where
        running rows' columns are live, so column c of those rows is saved first and put back after the warm-ups."""
        began = time.perf_counter()
        s = self.slots
        saved = []
        for step in steps:
            c, rows = min(s.t, step.cache.width - 1), step.cache.rows
            saved.append((c, rows, s.kv[:, :rows, :, c].clone(),
                          s.routes[:, :rows, c].clone() if s.routing is not None else None))
        for step, (c, *_) in zip(steps, saved):
            step.t_index.fill_(c)
            for mask in step.mask.values() if isinstance(step.mask, dict) else (step.mask,):
                mask.fill_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # after the saves and fills above
        for step in steps:
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(step)
        torch.cuda.current_stream().wait_stream(side)
        for c, rows, kv, routes in saved:
            s.kv[:, :rows, :, c] = kv
            if routes is not None:
                s.routes[:, :rows, c] = routes
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Collect first and keep the collector off while recording: a graph left in a reference cycle (an earlier
        # engine's) freed mid-recording resets itself, which CUDA forbids during capture and which ruins it.
        gc.collect()
        gc.disable()
        try:
            for step in steps:
                graph = step.graph = torch.cuda.CUDAGraph()  # kept on the step so a failed recording can be reset
                # on the warm-up's stream: its cuBLAS workspace
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    step.out = self._run(step)
                self.num_recorded += 1
        finally:
            gc.enable()
        self.record_seconds += time.perf_counter() - began
