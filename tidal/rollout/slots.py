"""A preallocated KV cache with one slot per running sequence: continuous batching without copies.

Why: with Hugging Face's ``DynamicCache`` every decode step concatenates one column onto each
layer's keys and values (a copy of the whole cache), dropping finished rows copies it again
(``batch_select_indices``) and joining new rows a third time. On the 1M-parameter tiny model those
copies took as long as all the matmuls (``tidal bench generate``, profiled with cProfile). Here the
buffers are allocated once and a step writes one column in place.

Layout, per layer: keys and values of shape [slots, heads, columns, head_dim], views of one buffer ``kv``
stacking every layer's (so a row move is one indexed copy, not two per layer).
- Running rows live in slots [0, n). When rows finish, rows from the end move into their slots
  (only the finished rows' worth of data moves), so the running batch stays a contiguous prefix.
- Every row writes its next token at one shared column ``t``; a row's sequence occupies columns
  [start[row], t). Rows that joined later start further right, and what lies left of a row's start
  is masked out exactly like left padding. Attention reads columns [lo, t] where ``lo`` is the
  earliest start of a running row.
- When ``t`` reaches the end of the buffer the live span moves back to column 0 (a copy once every
  few dozen steps, ``MOVE_ROOM``); when that would leave too little room, the buffers grow (doubling).
- The engine sizes the buffers before a call's first row joins (``reserve``, from the call's rows and length
  budget: ``sizing.py``), so a call grows nothing; growth stays the fallback for what the sizing could not know
  (a longer context arriving later), and ``num_growths`` counts it. With no row running the span is empty, so
  a call starts at the left edge: kept buffers are reused from column 0, not from where the last call ended.
- ``start`` has a host copy (``start_host``) kept alike, so ``lo`` is found without reading the device: removing
  rows then queues its copies and returns without waiting for the step in flight (issue 51).
- Each row's sampling key and generated-token count (``sample_keys``, ``gen_pos``) live here too, set on admission
  and moved with the row, so a step can sample without uploading them (``rollout.host_reads=late``,
  ``late_reads.py``).
- Speculative decoding writes k + 1 columns per row and step and marks the rejected ones (``rejected``); they
  are compacted out when the span must move anyway or when they are over half of it (``_compact``).
- An MoE model's expert choices per token (``routes``, uint8 [layers, slots, columns, k]; ``routes.py``) are
  written by its routers' hook in the same forward that writes the keys, at the same columns, and move with
  them in every copy below; a finished row's routes are read like its keys (``rows_routes``).

The model sees a Hugging Face ``Cache`` whose ``update`` writes in place and returns the live span,
and a ready 4-D boolean attention mask (so Hugging Face builds none, and applies no rule of its own).
Sliding-window layers (Mistral, Gemma 3's local layers; ``models/architecture.py``) get their own mask, a
dict keyed by layer type when layers differ: a key is in a query's window when their *positions* differ
by less than the window. A row's key positions are the running count of its live columns (those from its
start, less rejected drafts), so the window stays exact through left-aligned starts, rolled-back drafts,
compaction and every row move; the count is one cumulative sum over the [rows, span] mask the step
builds anyway, and is skipped for models without windows.
"""

from __future__ import annotations

import inspect

import torch
from transformers import Cache, DynamicCache

from tidal.models import moe
from tidal.models.architecture import attention_layout
from tidal.rollout.graphs import StaticDecoder, width_bucket
from tidal.rollout.routes import recording


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for the model's forward: transformers >= 5.2x names the KV cache ``cache`` and
    warns on every call that still passes ``past_key_values``; older releases only know the latter."""
    name = _CACHE_ARG.get(type(model))
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _CACHE_ARG[type(model)] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


_CACHE_ARG: dict[type, str] = {}


def last_logits_kwargs(model: torch.nn.Module) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it: a prefill needs the last position's
    logits only, and [rows x width x vocab] of them is gigabytes at a 152k vocabulary."""
    keep = _KEEP_ARG.get(type(model))
    if keep is None:
        keep = _KEEP_ARG[type(model)] = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if keep else {}


_KEEP_ARG: dict[type, bool] = {}

MOVE_ROOM = 64
"""Free columns a move of the live span back to the left must leave (``SlotCache._place``), else the buffers grow."""


class SlotCache(Cache):
    """Running rows' keys and values in preallocated slots (see module docstring), plus each
    row's last position id and next-token logits, which move with the row."""

    def __init__(self, model: torch.nn.Module, max_slots: int, min_columns: int = 64):
        super().__init__(layers=[])  # ``update`` below replaces the per-layer objects
        config = model.config.get_text_config()  # a vision-language model's decoder (Qwen2-VL: ``text_config``)
        self.layout = attention_layout(config)  # per layer type, its sliding window (None: full attention)
        self.num_layers = config.num_hidden_layers
        self.heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.max_slots = max_slots
        self.min_columns = min_columns
        self.n = 0  # running rows, in slots [0, n)
        self.t = 0  # the column the next token is written to
        self.lo = 0  # the earliest column a running row attends to
        self.kv = torch.zeros(0)
        self.keys: list[torch.Tensor] = []  # views of ``kv``, one per layer
        self.values: list[torch.Tensor] = []
        self.start = torch.zeros(0, dtype=torch.long, device=self.device)
        self.start_host = torch.zeros(0, dtype=torch.long)  # ``start`` on the host, kept alike (no read to find lo)
        self.sample_keys = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's sampling key
        self.gen_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's sampled tokens so far
        self.last_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.logits = torch.zeros(0, config.vocab_size, device=self.device)
        self.rejected = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        """[slots, columns]: columns a row's attention skips inside its span (draft tokens speculative decoding
        rejected, ``speculative.py``); all False without speculation."""
        self.has_rejected = False  # any rejected column in the live span: only then does a plain decode step mask them
        self.num_compactions = 0  # times the rejected columns were compacted out (``_compact``)
        self._width = 1  # columns each row writes in this forward (k + 1 while verifying k drafted tokens)
        self._fed: torch.Tensor | None = None  # during a shared decode: the slots the model runs on
        self.moved: tuple[torch.Tensor, torch.Tensor] | None = None  # the last ``remove``'s (dst, src) slots, on device
        self.generation = 0  # bumped whenever the buffers are reallocated
        self.num_sizings = 0  # reallocations with no row running (``reserve`` at a call's start: no copy)
        self.num_growths = 0  # reallocations while rows ran (each copies the live span and drops recorded graphs)
        self.routing = moe.routing_of(model)  # None: a dense model, which records no routes
        self.routes = torch.zeros(0, dtype=moe.ROUTE_DTYPE)
        """MoE models: [route layers, slots, columns, k] expert ids of each column's token, beside ``kv``."""
        self.static: StaticDecoder | None = None
        """Static-shape decode steps (CUDA graphs on a GPU, ``graphs.py``): set with ``use_static_decode``."""
        self._resize(0, 0)

    def use_static_decode(self, model: torch.nn.Module, capture: bool = True, widths: str = "full") -> None:
        """Decode with static shapes from now on, recorded as CUDA graphs when ``capture`` and on CUDA; ``widths``:
        ``rollout.graph_widths`` (``graphs.py``: attend over every column, or over the write column's width bucket)."""
        routing = self.routing

        def forward(input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
            with recording(routing, cache.write_routes):  # inside the recorded graph: replays write routes too
                return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]

        self.static = StaticDecoder(forward, self, capture, widths)

    # ---- what the model calls ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this step's column for every running row; return the span attention reads."""
        w = self._width
        assert key_states.shape[2] == w, "the slot cache only decodes (prefill runs on a DynamicCache)"
        k, v = self.keys[layer_idx], self.values[layer_idx]
        rows = slice(0, self.n) if self._fed is None else self._fed
        k[rows, :, self.t : self.t + w] = key_states
        v[rows, :, self.t : self.t + w] = value_states
        return k[rows, :, self.lo : self.t + w], v[rows, :, self.lo : self.t + w]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.t - self.lo

    def _write_routes(self, layer: int, ids_nk: torch.Tensor) -> None:
        """The routers' sink during a decode or verify forward: this forward's columns of the rows it runs."""
        w = self._width
        rows = slice(0, self.n) if self._fed is None else self._fed
        self.routes[layer, rows, self.t : self.t + w] = ids_nk.view(-1, w, ids_nk.shape[-1]).to(moe.ROUTE_DTYPE)

    # ---- decode -----------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, model: torch.nn.Module, tokens_n: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One forward over the running rows with their newest tokens; refreshes ``logits[:n]``.

        ``shared = (slots_u, inverse_n)``: rows holding identical contexts and newest tokens run once.
        The model runs on the u slots ``slots_u`` only; row i then copies the new column of keys and
        values and the logits of slot ``slots_u[inverse_n[i]]``."""
        self._place(0, extra=1)
        n = self.n
        pos = self.last_pos[:n] + 1
        if self.has_rejected:
            self.rejected[:n, self.t] = False  # a stale mark from an earlier use of this column
        if self.static is not None:
            assert shared is None, "static decode runs every row (no shared contexts)"
            self.logits[:n] = self.static.decode(tokens_n, pos)
            self.t += 1
            self.last_pos[:n] = pos
            return
        fed = slice(0, n) if shared is None else shared[0]
        cols = torch.arange(self.lo, self.t + 1, device=self.device)
        live = cols[None, :] >= self.start[fed, None]
        if self.has_rejected:
            live &= ~self.rejected[fed, self.lo : self.t + 1]
        mask = self.attention_mask(live[:, None, None, :], live, pos[fed, None])  # [rows fed, 1, q=1, span]
        self._fed = None if shared is None else shared[0]
        try:
            with recording(self.routing, self._write_routes):
                logits = model(input_ids=tokens_n[fed, None], attention_mask=mask, position_ids=pos[fed, None],
                               use_cache=True, **cache_kwargs(model, self)).logits[:, -1]
        finally:
            self._fed = None
        if shared is not None:
            slots_u, inverse_n = shared
            source_n = slots_u[inverse_n]
            for buf in (*self.keys, *self.values):
                buf[:n, :, self.t] = buf[source_n, :, self.t]
            if self.routing is not None:
                self.routes[:, :n, self.t] = self.routes[:, source_n, self.t]
            logits = logits[inverse_n]
        self.t += 1
        self.last_pos[:n] = pos
        self.logits[:n] = logits

    # ---- speculative decoding (``speculative.py``) --------------------------------------------
    def open_columns(self, width: int) -> None:
        """Before a verify step: make room for ``width`` new columns [t, t + width) and clear their marks. Then
        ``run`` feeds groups of rows (each group its own width <= ``width``) and ``accept`` closes the step."""
        self._place(0, extra=width)
        self.rejected[: self.n, self.t : self.t + width] = False

    @torch.no_grad()
    def run(self, model: torch.nn.Module, tokens_uw: torch.Tensor, slots_u: torch.Tensor) -> torch.Tensor:
        """One forward over the running rows in slots ``slots_u`` with w new tokens each (the newest sampled token
        and up to w - 1 drafted ones, padded); writes their columns [t, t + w) and returns the logits after each
        new token, [u, w, vocab]. A row attends to its live span (not its rejected columns) and causally to its
        new tokens. Rows that drafted nothing run in a group of width 1, so they cost what a decode step costs."""
        u, w = tokens_uw.shape
        assert self.t + w <= self.columns, "open_columns first"
        pos_uw = self.last_pos[slots_u, None] + 1 + torch.arange(w, device=self.device)
        cols = torch.arange(self.lo, self.t + w, device=self.device)
        live = (cols[None, :] >= self.start[slots_u, None]) & ~self.rejected[slots_u, self.lo : self.t + w]
        causal = (cols[None, :] < self.t) | (cols[None, :] - self.t <= torch.arange(w, device=self.device)[:, None])
        mask = self.attention_mask((live[:, None, :] & causal[None])[:, None], live, pos_uw)  # [u, 1, q=w, span]
        self._fed, self._width = slots_u, w
        try:
            with recording(self.routing, self._write_routes):
                return model(input_ids=tokens_uw, attention_mask=mask, position_ids=pos_uw,
                             use_cache=True, **cache_kwargs(model, self)).logits
        finally:
            self._fed, self._width = None, 1

    def attention_mask(self, full_r1qk: torch.Tensor, live_rk: torch.Tensor, query_pos_rq: torch.Tensor):
        """What the model takes as ``attention_mask`` from the full-attention mask [rows, 1, q, span]: itself
        without windows; else with each windowed layer type's mask too. ``live_rk`` marks the span's columns
        that hold the row's sequence (its new columns included), so their running count is each key's position."""
        if not self.layout.sliding:
            return full_r1qk
        return self.layout.masks(full_r1qk, query_pos_rq, live_rk.cumsum(-1) - 1)

    def copy_columns(self, dst: torch.Tensor, src: torch.Tensor, width: int) -> None:
        """Rows ``dst`` take the new columns [t, t + width) of rows ``src`` (identical rows that ``run`` ran once)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, self.t : self.t + width] = buf[src, :, self.t : self.t + width]
        if self.routing is not None:
            self.routes[:, dst, self.t : self.t + width] = self.routes[:, src, self.t : self.t + width]

    def accept(self, kept_n: torch.Tensor, logits_nv: torch.Tensor, width: int) -> None:
        """After ``run`` of groups at most ``width`` wide: row i keeps its first ``kept_n[i]`` new columns (the tokens
        it accepted) and the rest are rolled back (marked rejected: masked out from now on, their
        positions reused by the row's next tokens); ``logits_nv`` are the rows' next-token logits."""
        n = self.n
        offset = torch.arange(width, device=self.device)
        self.rejected[:n, self.t : self.t + width] = offset[None, :] >= kept_n[:, None]
        self.has_rejected = self.has_rejected or width > 1
        self.t += width
        self.last_pos[:n] += kept_n
        self.logits[:n] = logits_nv

    # ---- joining and leaving -----------------------------------------------------------------
    def admit(self, cache: DynamicCache, mask_dw: torch.Tensor, last_pos_d: torch.Tensor, logits_dv: torch.Tensor,
              source_k: torch.Tensor, routes_ldwk: torch.Tensor | None = None,
              row_state: tuple[list[int], list[int]] | None = None) -> None:
        """Append k rows after the running ones from a left-padded prefill of d distinct sequences;
        new row i copies prefill row ``source_k[i]`` (a group's samples share one prompt forward), its keys and
        values and, for an MoE model, its routes (``routes_ldwk``: uint8 [layers, d, width, k], ``routes.py``).
        ``row_state``: the new rows' sampling keys and generated-token counts, uploaded in one copy."""
        k, width = len(source_k), mask_dw.shape[1]
        assert self.n + k <= self.max_slots, f"{self.n} running + {k} new rows exceed {self.max_slots} slots"
        assert (routes_ldwk is None) == (self.routing is None), "an MoE model's prefill comes with its routes"
        if self.n + k > len(self.start):
            self._resize(min(self.max_slots, max(2 * len(self.start), self.n + k)), self.columns)
        self._place(width, extra=1)
        rows = slice(self.n, self.n + k)
        lengths_d = mask_dw.sum(dim=1).cpu()  # one read per admission: the new rows' spans, on the host
        self._clear_stale(rows, lo=int(self.t - lengths_d.max()))
        for layer, kv in enumerate(cache.layers):
            self.keys[layer][rows, :, self.t - width : self.t] = kv.keys[source_k]
            self.values[layer][rows, :, self.t - width : self.t] = kv.values[source_k]
        if routes_ldwk is not None:
            self.routes[:, rows, self.t - width : self.t] = routes_ldwk[:, source_k.to(routes_ldwk.device)]
        lengths = mask_dw.sum(dim=1)[source_k]
        self.rejected[rows] = False
        self.start[rows] = self.t - lengths
        self.last_pos[rows] = last_pos_d[source_k]
        self.logits[rows] = logits_dv[source_k].to(self.logits.dtype)
        self.start_host[rows] = self.t - lengths_d[source_k.cpu()]
        if row_state is not None:
            state = torch.tensor(row_state, dtype=torch.long).to(self.device, non_blocking=True)
            self.sample_keys[rows], self.gen_pos[rows] = state[0], state[1]
        self.lo = int(self.start_host[: self.n + k].min())
        self.n += k

    def _clear_stale(self, rows: slice, lo: int) -> None:
        """Zero what attention may read but masks out before new ``rows`` join with spans from column ``lo``: their
        slots (left by earlier rows), and the running rows' columns from ``lo`` to the current ``lo`` when the live
        span widens left. A masked column weighs exactly 0, but 0 x NaN is NaN: a NaN or inf an earlier row left in
        a masked column would reach every later row reading it. Zeros change no finite result."""
        self.kv[:, rows].zero_()
        if self.n and lo < self.lo:
            self.kv[:, : self.n, :, lo : self.lo].zero_()

    def remove(self, keep_n: torch.Tensor) -> tuple[list[int], list[int]]:
        """Drop the running rows where ``keep_n`` (on the host) is False: kept rows from the end move into the
        freed slots. Returns (destination slots, source slots) so the caller moves its rows alike; ``moved`` holds
        them on the device (None when nothing moved), for the caller's per-row device tensors. Nothing here waits
        for the device."""
        m = int(keep_n.sum())
        self.moved = None
        holes = (~keep_n[:m]).nonzero().squeeze(1)
        movers = keep_n[m:].nonzero().squeeze(1) + m
        if len(holes):
            # one upload of both index lists, then one gather for all layers' keys and values (``kv`` stacks them)
            dst, src = torch.stack([holes, movers]).to(self.device, non_blocking=True)
            # static decode reads every column up to its width (masked outside the span): the whole slot moves, so no
            # column the freed row left behind stays under the moved row (``_clear_stale``)
            cols = slice(None) if self.static is not None else slice(self.lo, self.t)
            self.kv[:, dst, :, cols] = self.kv[:, src, :, cols]
            if self.routing is not None:
                self.routes[:, dst, cols] = self.routes[:, src, cols]
            for per_row in (self.start, self.last_pos, self.logits, self.rejected, self.sample_keys, self.gen_pos):
                per_row[dst] = per_row[src]
            self.start_host[holes] = self.start_host[movers]
            self.moved = (dst, src)
        self.n = m
        self.lo = int(self.start_host[:m].min()) if m else self.t
        return holes.tolist(), movers.tolist()

    def row_kv(self, slot: int, drop_last: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of running row ``slot``'s keys and values, per layer [heads, len, head_dim], less its last
        ``drop_last`` live columns (a token fed only because the row was found finished one step late)."""
        span = slice(int(self.start_host[slot]), self.t)
        live = ~self.rejected[slot, span]  # without the columns of rejected drafts
        if drop_last:
            live[live.nonzero()[-drop_last:]] = False
        return ([k[slot, :, span][:, live].clone() for k in self.keys],
                [v[slot, :, span][:, live].clone() for v in self.values])

    def rows_routes(self, slots: list[int], lengths: list[int]) -> list[torch.Tensor]:
        """Routes of running rows ``slots`` on the CPU, each [its live columns, layers, k] (rejected drafts
        dropped, like ``row_kv``); ``lengths``: their live columns (the tokens each has fed, which the engine
        counts on the host). One gather and one device-to-host copy for all of them."""
        m, width = len(slots), max(lengths)
        lo, t = self.lo, self.t
        slots_m = torch.tensor(slots, device=self.device)
        cols = torch.arange(lo, t, device=self.device)
        live = (cols[None, :] >= self.start[slots_m, None]) & ~self.rejected[slots_m, lo:t]
        # a stable sort puts each row's live columns last, in order (``_compact``); it keeps the last ``width``
        order = live.to(torch.uint8).sort(dim=1, stable=True).indices[:, t - lo - width :]
        layers, _, _, k = self.routes.shape
        index = order[None, :, :, None].expand(layers, m, width, k)
        got = self.routes[:, slots_m, lo:t].gather(2, index).permute(1, 2, 0, 3).cpu()  # [m, width, layers, k]
        return [got[i, width - n :].clone() for i, n in enumerate(lengths)]

    def clear(self) -> None:
        """Forget every running row (the buffers stay allocated)."""
        self.n, self.lo = 0, self.t

    # ---- layout -------------------------------------------------------------------------------
    def reserve(self, rows: int, columns: int, shortest: int = 0) -> None:
        """Make the buffers at least ``rows`` (capped at ``max_slots``) x ``columns``, never smaller: kept buffers
        serve every later call that fits, so a steady caller allocates once. While rows run, rows grow at least
        twofold (amortized, as ``admit`` grows them). Then the static decoder's steps for up to ``rows`` running rows
        are built (recorded, on CUDA) here rather than in the middle of decoding; with width buckets, from the width
        of write column ``shortest`` (the shortest context that will decode: the call's shortest prompt) up."""
        rows, have = min(rows, self.max_slots), len(self.start)
        if rows > have or columns > self.columns:
            grown = min(self.max_slots, max(rows, 2 * have)) if rows > have and self.n else max(rows, have)
            self._resize(grown, max(columns, self.columns))
        if self.static is not None:
            self.static.prepare(rows, shortest)

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def _place(self, min_t: int, extra: int) -> None:
        """Make ``t >= min_t`` (room for a prefill of width ``min_t`` to end at t) and leave ``extra``
        free columns from ``t``, moving the live span left or right and growing if needed. Rejected
        columns are compacted out first when the span must move anyway, or when they are over half of it."""
        if self.has_rejected and self.n:
            live = int(self.last_pos[: self.n].max()) + 1  # the longest row's live columns (positions 0..last_pos)
            if self.t < min_t or self.t + extra > self.columns or 2 * live < self.t - self.lo:
                self._compact(min_t)
        if not self.n:  # nothing to move: start at the left edge, growing only what must grow
            if min_t + extra > self.columns:
                self._resize(len(self.start), max(2 * (min_t + extra), self.min_columns))
            self.lo = self.t = min_t
            return
        span = self.t - self.lo
        dst = max(0, min_t - span)
        need = dst + span + extra
        fits = self.t >= min_t and self.t + extra <= self.columns
        if fits and not self._narrows(need, self.t + extra):
            return
        # a move must leave ``MOVE_ROOM`` free columns (or ``need``, when smaller), else the buffers grow: a move copies
        # the span once, and each step's attention reads it anyway, so one move per 64 steps adds at most 1/64
        room = fits or need + min(need, MOVE_ROOM) <= self.columns
        columns = self.columns if room else max(2 * need, self.min_columns)
        if columns != self.columns:
            self._resize(len(self.start), columns, dst)
        elif self.n:
            for buf in (*self.keys, *self.values):
                buf[: self.n, :, dst : dst + span] = buf[: self.n, :, self.lo : self.t].clone()
            if self.routing is not None:
                self.routes[:, : self.n, dst : dst + span] = self.routes[:, : self.n, self.lo : self.t].clone()
            self.rejected[: self.n, dst : dst + span] = self.rejected[: self.n, self.lo : self.t].clone()
        self.start[: self.n] += dst - self.lo
        self.start_host[: self.n] += dst - self.lo
        self.lo, self.t = dst, dst + span

    def _narrows(self, need: int, end: int) -> bool:
        """With width buckets (``graphs.py``): whether moving the live span so that the columns it needs end at
        ``need`` rather than ``end`` puts the write column in a narrower width bucket. A span left far right (its
        earliest rows finished, later ones joined at ``t``) would otherwise make every step read the columns left of
        it: the move copies the span once and each later step reads at least span + 1 columns fewer (the narrower
        bucket is at most half the wider), and the next move needs the span to halve again, so moves stay rare."""
        static = self.static
        return (static is not None and static.buckets
                and width_bucket(need, self.columns) < width_bucket(end, self.columns))

    def _compact(self, min_t: int) -> None:
        """Move each running row's live columns (its span without the rejected ones, in order) to end at one
        column, at least ``min_t``, as far left as that allows: rolled-back drafts then cost neither attention
        width nor buffer growth, and the cache follows the accepted tokens as in plain decoding. Keys carry their
        rotary position, not their column, so moving them changes no result. In place: recorded graphs stay valid."""
        n, lo, t = self.n, self.lo, self.t
        cols = torch.arange(lo, t, device=self.device)
        live = (cols[None, :] >= self.start[:n, None]) & ~self.rejected[:n, lo:t]
        lengths = live.sum(dim=1)
        width = int(lengths.max())
        dst = max(0, min_t - width)
        # a stable sort puts each row's dead columns first and its live ones last, in order; the last ``width``
        # are the row's live columns, left-padded with dead ones (masked: they lie left of its new start)
        order = live.to(torch.uint8).sort(dim=1, stable=True).indices[:, t - lo - width :]
        for buf in (*self.keys, *self.values):
            index = order[:, None, :, None].expand(n, buf.shape[1], width, buf.shape[3])
            buf[:n, :, dst : dst + width] = buf[:n, :, lo:t].gather(2, index)
        if self.routing is not None:
            index = order[None, :, :, None].expand(self.routes.shape[0], n, width, self.routes.shape[3])
            self.routes[:, :n, dst : dst + width] = self.routes[:, :n, lo:t].gather(2, index)
        self.start[:n] = dst + width - lengths
        self.start_host[:n] = self.start[:n].cpu()
        self.rejected[:n] = False
        self.has_rejected = False
        self.lo, self.t = int(self.start_host[:n].min()), dst + width
        self.num_compactions += 1

    def _resize(self, slots: int, columns: int, dst: int | None = None) -> None:
        """Reallocate with ``slots`` x ``columns``, copying the live span to start at column ``dst``."""
        n, span = self.n, self.t - self.lo
        dst = self.lo if dst is None else dst
        if n:
            self.num_growths += 1
        elif self.keys:
            self.num_sizings += 1
        kv = torch.zeros(2 * self.num_layers, slots, self.heads, columns, self.head_dim,
                         dtype=self.dtype, device=self.device)
        if self.keys and n:
            kv[:, :n, :, dst : dst + span] = self.kv[:, :n, :, self.lo : self.t]
        self.kv = kv
        """[2 x layers, slots, heads, columns, head_dim]: every layer's keys, then every layer's values, in one
        buffer so that moving rows (``remove``) is one indexed copy rather than two per layer."""
        self.keys, self.values = list(kv[: self.num_layers]), list(kv[self.num_layers :])
        if self.routing is not None:
            routes = torch.full((self.routing.num_layers, slots, columns, self.routing.top_k), moe.NO_ROUTE,
                                dtype=moe.ROUTE_DTYPE, device=self.device)
            if n and self.routes.numel():
                routes[:, :n, dst : dst + span] = self.routes[:, :n, self.lo : self.t]
            self.routes = routes
        holes = torch.zeros(slots, columns, dtype=torch.bool, device=self.device)
        if n and self.rejected.numel():
            holes[:n, dst : dst + span] = self.rejected[:n, self.lo : self.t]
        self.rejected = holes
        self.generation += 1
        for name in ("start", "start_host", "sample_keys", "gen_pos", "last_pos", "logits"):
            old = getattr(self, name)
            new = old.new_zeros((slots, *old.shape[1:]))
            new[:n] = old[:n]
            setattr(self, name, new)
