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
- Attention reads every column of the slot buffers, ``[0, columns)``, instead of the live span; the mask
  admits a row's own columns ``[start, t]``. Masked columns weigh exactly 0, so the result is the dynamic
  step's up to summation order (tests compare them on the CPU, where the same static step runs eagerly).
- The new column ``t`` is written with ``index_copy_`` at a device index, so replays follow ``t``; an MoE
  model's expert ids too (``_BucketCache.write_routes``: the router hook runs while the graph is recorded).
- A model with sliding-window layers takes one static mask buffer per layer type (``SlotCache.attention_mask``
  builds them; the positions count a row's live columns over the whole width).

Graphs are recorded per (bucket, buffer) pair, all of a call's buckets at once when the slot cache is sized
(``prepare``, from ``SlotCache.reserve`` before the call's first row joins; one garbage collection for all of
them): recording mid-decode made an H200 RL step's first generate take 4.12 s against 2.06 s for the second
(issue 51). When the slot cache reallocates its buffers (more rows or columns) the recorded graphs are dropped;
a bucket decode meets unrecorded is recorded then (``num_late``: the fallback, counted). If recording fails
(a model whose forward synchronizes with the host, say) the engine says so once and decodes eagerly.
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


class _BucketCache(Cache):
    """The slot buffers' first ``rows`` slots as a Hugging Face cache: ``update`` writes column ``t_index`` in
    place and hands attention the whole buffer width (static shapes)."""

    def __init__(self, slots, rows: int, t_index: torch.Tensor):
        super().__init__(layers=[])
        self.slots, self.rows, self.t_index = slots, rows, t_index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k = self.slots.keys[layer_idx][: self.rows]
        v = self.slots.values[layer_idx][: self.rows]
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


@dataclass
class _Step:
    """One bucket's static inputs, its eager forward, and (on CUDA) its recorded graph and output."""

    tokens: torch.Tensor  # long [rows, 1]
    pos: torch.Tensor  # long [rows, 1]
    mask: torch.Tensor | dict[str, torch.Tensor]  # bool [rows, 1, 1, columns], or one per layer type (windows)
    t_index: torch.Tensor  # long [1]: the column this step writes
    cache: _BucketCache
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the graph's logits [rows, V]


class StaticDecoder:
    """One decode step over slots [0, bucket) with static shapes; on CUDA recorded once per bucket as a CUDA
    graph and replayed (``capture``), elsewhere run eagerly (the same computation, for tests)."""

    def __init__(self, forward: Callable[..., torch.Tensor], slots, capture: bool):
        """``forward(input_ids, attention_mask, position_ids, cache) -> logits [rows, V]``: the model's decode
        forward (``SlotCache.use_static_decode`` builds it)."""
        # A weak reference: the slot cache owns this decoder, and a cycle between them would leave an old engine's
        # graphs to the garbage collector, which may free them in the middle of a later recording.
        self.forward, self.slots = forward, weakref.proxy(slots)
        self.capture = capture and slots.device.type == "cuda"
        self._steps: dict[int, _Step] = {}
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
        self._follow_buffers()
        step = self._steps.get(rows)
        if step is None:
            self.num_late += 1
            step = self._build([rows])[0]
        step.tokens[:n, 0] = tokens_n
        step.tokens[n:] = 0
        step.pos[:n, 0] = pos_n
        step.pos[n:] = 0
        step.t_index.fill_(s.t)
        cols = torch.arange(s.columns, device=s.device)
        start = torch.full((rows,), s.t, dtype=torch.long, device=s.device)  # padding rows see column t only
        start[:n] = s.start[:n]
        live = (cols >= start[:, None]) & (cols <= s.t)
        if s.has_rejected:  # speculative decoding's rolled-back drafts (``slots.py``)
            live[:n] &= ~s.rejected[:n]
        _copy_masks(step.mask, s.attention_mask(live[:, None, None, :], live, step.pos))
        if step.graph is None:
            return self._run(step)[:n]
        step.graph.replay()
        return step.out[:n]

    def prepare(self, max_rows: int) -> None:
        """Build (on CUDA: record) the step of every bucket a batch of up to ``max_rows`` running rows meets as its
        rows finish, each once per buffer allocation: a second call of the same shape builds nothing."""
        self._follow_buffers()
        cap = len(self.slots.start)
        wanted = sorted({bucket(n, cap) for n in range(1, max_rows + 1)} - self._steps.keys())
        if wanted:
            self._build(wanted)

    def _follow_buffers(self) -> None:
        if self._generation != self.slots.generation:  # reallocated buffers: recorded graphs point at freed memory
            self._steps.clear()
            self._generation = self.slots.generation

    def _build(self, buckets: list[int]) -> list[_Step]:
        s = self.slots
        steps = []
        for rows in buckets:
            t_index = torch.zeros(1, dtype=torch.long, device=s.device)
            steps.append(_Step(tokens=torch.zeros(rows, 1, dtype=torch.long, device=s.device),
                               pos=torch.zeros(rows, 1, dtype=torch.long, device=s.device),
                               mask=s.layout.build(lambda _, rows=rows: torch.zeros(rows, 1, 1, s.columns,
                                                                                    dtype=torch.bool, device=s.device)),
                               t_index=t_index, cache=_BucketCache(s, rows, t_index)))
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
        for rows, step in zip(buckets, steps):
            self._steps[rows] = step
        self.num_built += len(steps)
        return steps

    def _run(self, step: _Step) -> torch.Tensor:
        """The bucket's forward (no closures: nothing here may hold a cycle that keeps graphs alive)."""
        return self.forward(step.tokens, step.mask, step.pos, step.cache)

    def _record(self, steps: list[_Step]) -> None:
        """Warm up on a side stream (as ``torch.cuda.graphs`` requires), then record each step, with one garbage
        collection for all of them. Warm-up and recording write column ``t`` of rows [0, bucket): the running rows'
        next column and free slots, both overwritten by the real step (or zeroed when a row joins there)."""
        began = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for step in steps:
            step.t_index.fill_(self.slots.t)
            for mask in step.mask.values() if isinstance(step.mask, dict) else (step.mask,):
                mask.fill_(True)
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(step)
        torch.cuda.current_stream().wait_stream(side)
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
