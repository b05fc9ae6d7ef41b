"""The embedded local engine: continuous batching with a KV cache, interruptible between tokens.

How a batch is generated:
1. Prefill: each distinct prompt is run once (left-padded) and its keys and values are copied to
   each of the group's samples, so a group of N costs one prompt forward.
2. Decode: one forward per step over the running rows, whose keys and values live in a
   preallocated slot cache (``slots.py``: each step writes one column in place). A row that
   finishes leaves at once and a waiting request takes its slot at the next step, so a long-tailed
   batch pays neither for padding nor for waiting on its longest row. With ``rollout.host_reads=late`` each
   step's sampled tokens feed the next decode from the device and reach the host one step later, so the host's
   per-row work overlaps the device's step (``late_reads.py``).
3. Interruption (AReaL-style): between two decode steps the engine checks for a pending weight
   update. If there is one it loads the weights, bumps its version, re-prefills every unfinished
   sequence (prompt + tokens so far) under the new weights and continues. Tokens sampled after the
   switch carry the new version; nothing generated is thrown away.

Sampling noise is keyed by (run seed, prompt uid, sample index, position) (see ``sampling.py``), so
an interrupted generation with unchanged weights yields the same tokens as an uninterrupted one.

An MoE model's expert choices are recorded with each sample (``Trajectory.routes``, ``routes.py``): each
forward's routers write them next to the tokens' keys and values, and a re-prefill after a weight update
records the new weights' choices, as it recomputes the keys.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from tidal.api import GenRequest
from tidal.models import lora, moe, vlm
from tidal.models.architecture import check_architecture
from tidal.models.prompts import end_of_turn_ids
from tidal.models.quant import dequantize_state_dict
from tidal.models.tied import load_weights
from tidal.rollout.decode_attention import use_engine_attention
from tidal.rollout.graphs import GRAPH_WIDTHS
from tidal.rollout.head import HEAD_DTYPES, fill_head, keep_head_fp32
from tidal.rollout.late_reads import late_reads
from tidal.rollout.requests import finished_trajectory, generate_by_stream, sampling_key
from tidal.rollout.routes import ForwardRoutes, recording, unfed_last
from tidal.rollout.sampling import sample_tokens
from tidal.rollout.sampling_config import SamplingConfig  # defined there, imported from here as before
from tidal.rollout.sizing import slot_shape
from tidal.rollout.slots import SlotCache, cache_kwargs, last_logits_kwargs
from tidal.rollout.speculative import build_speculator
from tidal.rollout.thinking import open_close_prefix
from tidal.rollout.turns import TurnKV, TurnStore
from tidal.rollout.vision import EngineImages, context_key
from tidal.types import Trajectory
from tidal.utils.device import model_device, resolve_dtype


@dataclass
class _Row:
    request: GenRequest
    key: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    confident_run: int = 0  # consecutive tokens sampled with probability > early_stop_prob
    node: int = -1  # rows with the same node hold the same context (prompt + tokens fed), the same keys and values
    forced_at: list[int] = field(default_factory=list)  # positions of tokens the engine forced (thinking.py)
    think_closed: bool = False
    close_from: int = 0  # close tokens the model had already written when forcing began (thinking.py)
    draft_state: object = None  # the drafter's per-row state (speculative.py), e.g. its n-gram index


RequestSource = Callable[[int, bool], "list[GenRequest] | None"]


class LocalEngine:
    """In-process engine on a private copy of a Hugging Face causal LM (see module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: SamplingConfig, seed: int = 0, version: int = 0,
                 draft_model: torch.nn.Module | None = None):
        # A LoRA policy (PEFT model): a plain copy with the adapters merged, plus the adapted layers' base
        # weights, from which each adapter update is merged again (``models/lora.py``)
        model, self._lora_base = lora.engine_copy(model)
        self.model = model.eval().requires_grad_(False)
        check_architecture(self.model)  # one line naming a feature the slot cache's masks would get wrong
        use_engine_attention(self.model, cfg.decode_attention)
        self.device = model_device(self.model)
        self.dtype = resolve_dtype(cfg.dtype, self.device, "rollout.dtype")
        self.model.to(self.dtype)
        # MoE: the routers' hooks record each forward's expert ids (``routes.py``); the copy records, never replays
        # (a plan or kept logits the trainer had set on the policy it was copied from do not apply to it)
        self._routing = moe.routing_of(self.model)
        if self._routing is not None:
            self._routing.clear_plan()
            self._routing.keep_logits = False
            self._routing.drop_logits()
        if cfg.graph_widths not in GRAPH_WIDTHS:
            raise ValueError(f"rollout.graph_widths={cfg.graph_widths!r}: one of {', '.join(GRAPH_WIDTHS)}")
        if cfg.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"rollout.head_dtype={cfg.head_dtype!r}: one of {', '.join(HEAD_DTYPES)}")
        self._head_ties = keep_head_fp32(self.model) if cfg.head_dtype == "fp32" and self.dtype != torch.float32 else {}
        if self._lora_base is not None:
            self._lora_base = {k: v.to(self.dtype) for k, v in self._lora_base.items()}
        self._static_decode = cfg.cuda_graphs == "on" or (cfg.cuda_graphs == "auto" and self.device.type == "cuda")
        self._slots: SlotCache | None = None  # kept across calls with static decode: its graphs are recorded once
        self._slots_in_use = False
        self.size_up_front = True
        """Size the slot cache from a call's requests before its first row joins (``sizing.py``); False grows it by
        doubling as rows and columns run out (the path before issue 51; tests compare the two)."""
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.version = version
        self.eos_id = tokenizer.eos_token_id
        self.end_ids = end_of_turn_ids(tokenizer, model)  # EOS and the generation config's end-of-turn ids
        self.pad_id = tokenizer.pad_token_id
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._lock = threading.Lock()
        stop_lengths = (len(tokenizer(s, add_special_tokens=False).input_ids) for s in cfg.stop)
        self._stop_max_tokens = max(stop_lengths, default=0)
        self._early_stop_logp = math.log(cfg.early_stop_prob)
        self.num_generated_tokens = 0
        self.generate_seconds = 0.0
        self.num_interruptions = 0
        self.num_weight_updates = 0
        self._turn_kv = TurnStore()
        self.num_reused_tokens = 0
        self.num_shared_decodes = 0  # row-steps whose decode was copied from an identical row
        # Engine counters (issue 51): where a decode step's time goes. Host time is the step's wall-clock time on
        # the host: on CUDA the time to issue it (plus any read that waits for the device), on the CPU all of it.
        self.num_decode_steps = 0
        self.decode_host_seconds = 0.0
        self.num_removed_rows = 0  # rows dropped from the slot cache (each a slot move when not the last)
        self._next_node = 0
        # Speculative decoding (off: None). Its verify forward has a dynamic width and runs eagerly; a step where no
        # row drafted is a plain decode step, replayed from a CUDA graph where plain decoding would be
        self._spec = build_speculator(cfg.speculative, self, draft_model)
        # A vision-language model with its processor: prompts with images prefill through ``vision.py``
        processor = vlm.processor_of(tokenizer)
        self._images = EngineImages(self.model, processor) if processor is not None and vlm.is_vlm(self.model) else None
        self._late = late_reads(self)  # ``rollout.host_reads=late`` (``late_reads.py``); None: synchronous reads

    # ---- weights ---------------------------------------------------------------------------
    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage new weights; applied at the next interruption point (thread-safe)."""
        with self._lock:
            self._pending = (dict(state_dict), version)

    def _apply_pending_update(self) -> bool:
        """Load staged weights, if any. An update that fails stays staged, so it is raised again by the
        next ``stream`` before any request rather than skipped (a caller that restarts ``stream`` after
        an error, as the endpoint's bridge does, must never go on generating with the old weights)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return False
        state_dict, version = pending
        if lora.is_adapter_update(state_dict):  # LoRA: adapters only, merged into the engine's copy
            if self._lora_base is None:
                raise RuntimeError("an adapter update reached an engine built from a model without LoRA adapters")
            lora.apply_update(self.model, self._lora_base, state_dict)
        else:
            state_dict = dequantize_state_dict(state_dict, next(self.model.parameters()).dtype)  # fp8_block sync
            # strict (a mismatched checkpoint must fail loudly), but a tied head comes as its embedding only
            load_weights(self.model, fill_head(state_dict, self._head_ties))
        with self._lock:
            if self._pending is pending:  # not replaced by a newer update meanwhile
                self._pending = None
        self.version = version
        self._turn_kv.clear()  # computed with the old weights
        if self._images is not None:
            self._images.clear()  # so were the kept image features
        self.num_weight_updates += 1
        return True

    def stats(self) -> dict[str, float]:
        s = max(self.generate_seconds, 1e-9)
        return {
            "perf/gen_tokens_per_s": self.num_generated_tokens / s,
            "rollout/engine_busy_s": self.generate_seconds,
            "rollout/interruptions": float(self.num_interruptions),
            "rollout/weight_updates": float(self.num_weight_updates),
            "rollout/reused_kv_tokens": float(self.num_reused_tokens),
            "rollout/shared_decode_frac": self.num_shared_decodes / max(self.num_generated_tokens, 1),
            **self._step_counters(),
            **(self._spec.stats() if self._spec is not None else {}),
            **(self._late.stats() if self._late is not None else {}),
            **(self._images.stats() if self._images is not None else {}),
        }

    def _step_counters(self) -> dict[str, float]:
        """Decode steps, their mean host time, removed rows, graph recordings (and those decode had to make) and slot
        cache growths while rows ran (cumulative, per process)."""
        static = self._slots.static if self._slots is not None else None
        return {
            "rollout/decode_steps": float(self.num_decode_steps),
            "rollout/decode_step_host_ms": 1e3 * self.decode_host_seconds / max(self.num_decode_steps, 1),
            "rollout/removed_rows": float(self.num_removed_rows),
            "rollout/graph_recordings": float(static.num_recorded if static is not None else 0),
            "rollout/graph_record_s": static.record_seconds if static is not None else 0.0,
            "rollout/graph_late_steps": float(static.num_late if static is not None else 0),
            "rollout/slot_resizes": float(self._slots.num_growths if self._slots is not None else 0),
        }

    # ---- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        """Generate one trajectory per request, in request order (the slot cache sized for them all first)."""
        return generate_by_stream(functools.partial(self.stream, size_for=requests), requests, greedy)

    def prepare(self, requests: Sequence[GenRequest], joins_later: bool = False) -> None:
        """Size the slot cache for a ``generate`` of ``requests`` and record its decode steps now, so that no call's
        timed work pays for them (``generate`` sizes at its start anyway; this only moves the work ahead).
        ``joins_later``: for a ``stream`` whose rows join while others run (the async controller), with the
        columns their moves need (``sizing.py``)."""
        slots = self._slot_cache()
        try:
            self._reserve(slots, requests, joins_later=joins_later)
        finally:
            if slots is self._slots:
                self._slots_in_use = False

    def _reserve(self, slots: SlotCache, requests: Sequence[GenRequest], joins_later: bool, running: int = 0) -> None:
        """Grow ``slots`` (never shrink it) to what ``requests`` can need, joining ``running`` rows (``sizing.py``)."""
        if not self.size_up_front or not requests:
            return
        draft = self.cfg.speculative.num_draft_tokens if self._spec is not None else 0
        rows, columns = slot_shape(requests, self.cfg.max_new_tokens, self.cfg.max_batch_size, draft, joins_later)
        slots.reserve(min(running + rows, self.cfg.max_batch_size), columns, min(len(r.prompt_ids) for r in requests))

    @torch.no_grad()
    def stream(self, source: RequestSource, on_done: Callable[[GenRequest, Trajectory], None],
               greedy: bool = False, size_for: Sequence[GenRequest] = ()) -> None:
        """Continuous batching: decode until ``source`` is exhausted and every row has finished.

        Whenever the running batch has free slots (``max_batch_size`` rows), ``source(n, block)`` is
        asked for up to n more requests (``block`` is True only when nothing is running); it returns
        a list (possibly empty) or None once it will never give more. New rows are prefilled and
        joined to the running batch, so the long tail of one batch overlaps the start of the next.
        Finished trajectories go to ``on_done`` as soon as they finish. The slot cache is sized for ``size_for``
        (every request the call will see: ``generate``) before anything runs, else as each admission arrives.
        """
        start = time.perf_counter()
        temperature = 0.0 if greedy else self.cfg.temperature
        rows: list[_Row] = []  # the running batch, row i in slot i of ``slots``
        slots = self._slot_cache()
        exhausted = False
        late = self._late.begin() if self._late is not None else None  # None: read before the next decode
        try:
            self._reserve(slots, size_for, joins_later=False)
            while True:
                if self._apply_pending_update() and rows:  # interruption point: re-read under new weights
                    rows = self._reprefill(slots, rows, late, on_done)
                free = self.cfg.max_batch_size - len(rows)
                if free > 0 and not exhausted:
                    self.generate_seconds += time.perf_counter() - start
                    new = source(free, not rows)
                    start = time.perf_counter()
                    if new is None:
                        exhausted = True
                    elif new:
                        if self._apply_pending_update() and rows:  # arrived while we waited
                            rows = self._reprefill(slots, rows, late, on_done)
                        if late is not None:  # rows join a batch whose tokens are exact
                            rows = late.drain(rows, slots, on_done)
                            if not late.admits(new):
                                late.end()
                                late = None
                        if not size_for:
                            self._reserve(slots, new, joins_later=True, running=len(rows))
                        new_rows = [_Row(r, sampling_key(self.seed, r)) for r in new]
                        saved = [self._saved_turn(r) for r in new]
                        fresh = [row for row, kv in zip(new_rows, saved) if kv is None]
                        resumed = [(row, kv) for row, kv in zip(new_rows, saved) if kv is not None]
                        if fresh:
                            self._prefill(slots, fresh)
                        if resumed:
                            self._prefill_after(slots, resumed)
                        rows += fresh + [row for row, _ in resumed]
                if not rows:
                    if exhausted:
                        return
                    continue
                step = self._sample_step if self._spec is None else self._spec.step
                step = late.step if late is not None else step
                began = time.perf_counter()
                rows = step(rows, slots, temperature, on_done)
                self.decode_host_seconds += time.perf_counter() - began
                self.num_decode_steps += 1
        finally:
            if late is not None:
                late.end()
            self.generate_seconds += time.perf_counter() - start
            if slots is self._slots:
                self._slots_in_use = False

    def _slot_cache(self) -> SlotCache:
        """The engine's own slot cache, emptied: its buffers are allocated (and zero-filled) once, not on every
        call, which took 10-20% of a call's time on the CPU (``tidal bench generate``, 512 rows; docs/speculative.md),
        and with static decode its recorded graphs stay valid (weights are updated in place). It keeps the largest
        size it grew to. A second ``stream`` running at the same time on this engine gets a fresh one."""
        with self._lock:
            shared = not self._slots_in_use
            self._slots_in_use = self._slots_in_use or shared
        if not shared:
            return SlotCache(self.model, self.cfg.max_batch_size)
        if self._slots is None:
            self._slots = SlotCache(self.model, self.cfg.max_batch_size)
            if self._static_decode:
                self._slots.use_static_decode(self.model, widths=self.cfg.graph_widths)
        self._slots.clear()
        return self._slots

    def _reprefill(self, slots: SlotCache, rows: list[_Row], late=None, on_done=None) -> list[_Row]:
        """After a weight update: recompute every running row's cache (prompt + tokens so far, the pending late
        step's included: drained first); return the rows still running."""
        rows = late.drain(rows, slots, on_done) if late is not None else rows
        if rows:
            self.num_interruptions += 1
            slots.clear()
            self._prefill(slots, rows)
        return rows

    def _sample_step(self, rows: list[_Row], slots: SlotCache, temperature: float, on_done) -> list[_Row]:
        """Sample one token for every running row, hand finished rows out, decode the rest one step."""
        rows, tokens = self._sample_next(rows, slots, temperature, on_done)
        if rows:
            self._decode(rows, slots, tokens)
        return rows

    def _decode(self, rows: list[_Row], slots: SlotCache, tokens: torch.Tensor) -> int:
        """Feed each running row its newest token (one column; identical rows once); return the rows run. A
        speculative step where no row drafted runs exactly this (``speculative.py``)."""
        shared = self._distinct_contexts(rows, tokens)
        if shared is not None:
            self.num_shared_decodes += len(rows) - len(shared[0])
        slots.decode(self.model, tokens, shared)
        return len(rows) if shared is None else len(shared[0])

    def _sample_next(self, rows: list[_Row], slots: SlotCache, temperature: float,
                     on_done) -> tuple[list[_Row], torch.Tensor]:
        """Sample every running row's next token from its logits in ``slots`` (budget forcing applied),
        hand out the rows it finishes; return the running rows and their new tokens."""
        n = len(rows)
        keys = torch.tensor([r.key for r in rows], dtype=torch.int64, device=self.device)
        gen_pos = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64, device=self.device)
        tokens, logps = sample_tokens(slots.logits[:n], keys, gen_pos, temperature, self.cfg.top_p)
        self._force_think_close(rows, tokens, logps)
        keep = torch.ones(n, dtype=torch.bool)
        for slot, (row, tok, lp) in enumerate(zip(rows, tokens.tolist(), logps.tolist())):
            keep[slot] = not self._append(row, tok, lp)
        self.num_generated_tokens += n
        return self._retire(rows, keep, slots, on_done, tokens)

    def _append(self, row: _Row, tok: int, lp: float, version: int | None = None) -> bool:
        """Append one sampled token to ``row`` (with its log-prob and the version it was sampled with, the
        engine's unless given); True when the row has finished (EOS or a stop string, its length budget, or an
        early-truncation run)."""
        row.tokens.append(tok)
        row.logprobs.append(lp)
        row.versions.append(self.version if version is None else version)
        row.confident_run = row.confident_run + 1 if lp > self._early_stop_logp else 0
        if tok in self.end_ids or self._hit_stop(row):
            row.finish_reason = "stop"
        elif len(row.tokens) >= (row.request.max_new_tokens or self.cfg.max_new_tokens):
            row.finish_reason = "length"
        elif self.cfg.early_stop_run is not None and row.confident_run >= self.cfg.early_stop_run:
            row.finish_reason = "repetition"
        else:
            return False
        return True

    def _retire(self, rows: list[_Row], keep: torch.Tensor, slots: SlotCache, on_done,
                tokens: torch.Tensor | None = None, fed_last: bool = False) -> tuple[list[_Row], torch.Tensor | None]:
        """Hand out the rows where ``keep`` (on the host) is False (keeping an episode turn's keys and values) and
        drop them from ``slots``; ``rows`` (and ``tokens``, per row on the device) follow the slots' moves.
        ``fed_last``: the rows' last tokens were fed (found finished one step late, ``late_reads.py``): that column
        is not theirs in the synchronous path, so it is left out of their routes and kept turns."""
        done = (~keep).nonzero().squeeze(1).tolist()
        routes: list[torch.Tensor | None] = [None] * len(done)
        if done and slots.routing is not None:  # every token but the last sampled one was fed (or all of them)
            lengths = [len(rows[i].request.prompt_ids) + len(rows[i].tokens) - 1 + fed_last for i in done]
            routes = [r[: len(r) - fed_last] for r in slots.rows_routes(done, lengths)]
        for slot, row_routes in zip(done, routes):
            row = rows[slot]
            if self.cfg.reuse_turn_kv and row.request.episode and row.tokens[-1] not in self.end_ids:
                self._save_turn(row, slots, slot, row_routes, fed_last)  # the episode's next turn extends it
            on_done(row.request, self._to_trajectory(row, row_routes))
        if not keep.all():
            self.num_removed_rows += len(keep) - int(keep.sum())
            holes, movers = slots.remove(keep)
            for hole, mover in zip(holes, movers):
                rows[hole] = rows[mover]
            rows = rows[: slots.n]
            if tokens is not None and slots.moved is not None:  # device indices: no upload that waits
                tokens[slots.moved[0]] = tokens[slots.moved[1]]
            tokens = tokens[: slots.n] if tokens is not None else None
        return rows, tokens

    def _distinct_contexts(self, rows: list[_Row], tokens_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Give each row the node of its context after feeding its newest token; return (one slot per
        distinct node, each row's index into those), or None when every row is distinct (or sharing
        is off). Rows sharing a node before the token and sampling the same token share one after."""
        if not self.cfg.share_identical_rows or self._static_decode:
            return None
        after: dict[tuple[int, int], int] = {}
        first_slot: list[int] = []
        inverse: list[int] = []
        for slot, (row, tok) in enumerate(zip(rows, tokens_n.tolist())):  # only here: the host needs the tokens
            j = after.get((row.node, tok))
            if j is None:
                j = after[(row.node, tok)] = len(first_slot)
                first_slot.append(slot)
            row.node = self._next_node + j
            inverse.append(j)
        self._next_node += len(first_slot)
        if len(first_slot) == len(rows):
            return None
        return torch.tensor(first_slot), torch.tensor(inverse)

    @staticmethod
    def _force_think_close(rows: list[_Row], tokens: torch.Tensor, logps: torch.Tensor) -> None:
        """Budget forcing (``thinking.py``, s1 arXiv 2501.19393): a row that has spent its thinking budget
        without closing the section gets the close tokens, one per step, in place of its samples (in
        ``tokens``, log-prob 0 in ``logps``; ``_to_trajectory`` masks them out of the loss). A close the
        model had begun when the budget ran out (its last tokens a prefix of the close) is completed,
        not written again after the prefix."""
        for slot, row in enumerate(rows):
            close, budget = row.request.thinking_close, row.request.thinking_budget
            if budget is None or row.think_closed:
                continue
            if not row.forced_at and tuple(row.tokens[len(row.tokens) - len(close):]) == close:
                row.think_closed = True  # the model closed it within budget
                continue
            if row.forced_at or len(row.tokens) >= budget:
                if not row.forced_at:
                    row.close_from = open_close_prefix(row.tokens, close)
                k = row.close_from + len(row.forced_at)
                tokens[slot], logps[slot] = close[k], 0.0
                row.forced_at.append(len(row.tokens))
                row.think_closed = k + 1 == len(close)

    def _prefill(self, slots: SlotCache, rows: list[_Row]) -> None:
        """Forward prompts (+ tokens so far) of ``rows`` (left-padded, on a fresh DynamicCache) and
        append them to the running batch in ``slots``. Each distinct sequence runs once (a group's
        samples share their prompt) and its rows copy it."""
        seqs: list[tuple[int, ...]] = []
        index: dict[object, int] = {}
        source: list[int] = []
        firsts: list[_Row] = []  # each distinct sequence's first row (its prompt: its images)
        for i, row in enumerate(rows):
            seq = (*row.request.prompt_ids, *row.tokens)
            key = context_key(row.request, seq) if self.cfg.share_identical_rows or not row.tokens else i
            d = index.get(key)  # off: only prompts shared (and a prompt with images only with its own group)
            if d is None:
                d = index[key] = len(seqs)
                seqs.append(seq)
                firsts.append(row)
            source.append(d)
            row.node = self._next_node + d
        self._next_node += len(seqs)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
        # laid out on the host, before the upload: nothing waits on the device
        pictures = None if self._images is None else self._images.inputs(ids, mask, [r.request for r in firsts])
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": ids, "position_ids": positions}
        if pictures is not None:  # image features over the prompts' image tokens, M-RoPE positions (``vision.py``)
            inputs = {"inputs_embeds": pictures[0], "position_ids": pictures[1]}
            positions = pictures[1][0]  # a row's last token is text: its three ids agree, and decoding goes on from it
        cache = DynamicCache()
        routes = ForwardRoutes(self._routing) if self._routing is not None else None
        with recording(self._routing, routes):
            logits = self.model(**inputs, attention_mask=mask, use_cache=True,
                                **cache_kwargs(self.model, cache), **last_logits_kwargs(self.model)).logits[:, -1]
        slots.admit(cache, mask, positions[:, -1], logits, torch.tensor(source),
                    routes.stacked(len(seqs), width) if routes is not None else None, self._row_state(rows))

    def _save_turn(self, row: _Row, slots: SlotCache, slot: int, routes: torch.Tensor | None,
                   fed_last: bool = False) -> None:
        """Keep the keys and values of ``row``'s sequence (its last sampled token not fed, or fed but left out:
        ``fed_last``), and its routes (MoE: the next turn's reused prefix keeps the experts it was computed with)."""
        tokens = (*row.request.prompt_ids, *row.tokens[:-1])
        keys, values = slots.row_kv(slot, drop_last=int(fed_last))
        assert keys[0].shape[1] == len(tokens), "slot span and sequence disagree"
        kv = TurnKV(tokens, keys, values, self.version, routes)
        cache_positions = len(slots.start) * slots.columns  # what the running batch's cache holds now
        self._turn_kv.put((row.request.prompt.uid, row.request.sample_index), kv,
                          max_turns=self.cfg.max_batch_size, max_tokens=max(cache_positions, len(tokens)))

    def _saved_turn(self, request: GenRequest) -> TurnKV | None:
        """The kept keys and values this request's context extends (same weights), if any."""
        if not self._turn_kv:
            return None
        kv = self._turn_kv.take((request.prompt.uid, request.sample_index))
        if (kv is None or kv.version != self.version or len(request.prompt_ids) <= len(kv.tokens)
                or tuple(request.prompt_ids[: len(kv.tokens)]) != kv.tokens):
            return None
        return kv

    def _prefill_after(self, slots: SlotCache, resumed: list[tuple[_Row, TurnKV]]) -> None:
        """Join rows whose context extends kept keys and values: run only the last S columns, S the
        longest new part, over the kept prefix (right-aligned as in ``_prefill``; a row whose new part
        is shorter recomputes a few kept tokens), then admit them like a fresh prefill. Rows with pictures take the
        window's embeddings and M-RoPE positions from ``EngineImages.window_inputs``."""
        seqs = [list(row.request.prompt_ids) for row, _ in resumed]
        width = max(map(len, seqs))
        window = max(len(seq) - len(kv.tokens) for seq, (_, kv) in zip(seqs, resumed))
        n, past = len(seqs), width - window
        ids = torch.full((n, window), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        first = resumed[0][1]
        past_k = [k.new_zeros(n, k.shape[0], past, k.shape[2]) for k in first.keys]
        past_v = [v.new_zeros(n, v.shape[0], past, v.shape[2]) for v in first.values]
        for r, (seq, (_, kv)) in enumerate(zip(seqs, resumed)):
            mask[r, width - len(seq):] = 1
            tail = seq[max(0, len(seq) - window):]
            ids[r, window - len(tail):] = torch.tensor(tail)
            kept = len(seq) - window  # tokens before the window, all inside the kept span
            if kept > 0:
                for layer in range(len(past_k)):
                    past_k[layer][r, :, past - kept:] = kv.keys[layer][:, :kept]
                    past_v[layer][r, :, past - kept:] = kv.values[layer][:, :kept]
            self.num_reused_tokens += max(kept, 0)
        # laid out on the host, before the upload (``vision.py``: the window's image features and M-RoPE positions)
        pictures = (None if self._images is None
                    else self._images.window_inputs(ids, mask, [row.request for row, _ in resumed]))
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": ids, "position_ids": positions[:, past:]}
        last = positions[:, -1]
        if pictures is not None:
            inputs = {"inputs_embeds": pictures[0], "position_ids": pictures[1]}
            last = pictures[1][0][:, -1]  # the context's last position (text: its three ids agree)
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(past_k, past_v)):
            cache.update(k, v, layer)
        routes = ForwardRoutes(self._routing) if self._routing is not None else None
        with recording(self._routing, routes):
            logits = self.model(**inputs, attention_mask=mask, use_cache=True,
                                **cache_kwargs(self.model, cache), **last_logits_kwargs(self.model)).logits[:, -1]
        for row, _ in resumed:  # each its own context
            row.node, self._next_node = self._next_node, self._next_node + 1
        slots.admit(cache, mask, last, logits, torch.arange(n),
                    self._routes_after(routes, resumed, past, window) if routes is not None else None,
                    self._row_state([row for row, _ in resumed]))

    def _routes_after(self, recorded: ForwardRoutes, resumed: list[tuple[_Row, TurnKV]], past: int,
                      window: int) -> torch.Tensor:
        """``_prefill_after``'s routes [layers, n, past + window, k]: the kept prefix's from the kept turns (the
        experts those keys were computed with), the window's from this forward."""
        n, r = len(resumed), self._routing
        kept_routes = torch.full((r.num_layers, n, past, r.top_k), moe.NO_ROUTE, dtype=moe.ROUTE_DTYPE)
        for i, (row, kv) in enumerate(resumed):
            kept = len(row.request.prompt_ids) - window
            if kept > 0:
                kept_routes[:, i, past - kept :] = kv.routes[:kept].permute(1, 0, 2)
        return torch.cat([kept_routes.to(self.device), recorded.stacked(n, window)], dim=2)

    @staticmethod
    def _row_state(rows: list[_Row]) -> tuple[list[int], list[int]]:
        """The rows' sampling keys and tokens so far: their device state in the slot cache (``late_reads.py``)."""
        return [row.key for row in rows], [len(row.tokens) for row in rows]

    def _hit_stop(self, row: _Row) -> bool:
        if not self._stop_max_tokens:
            return False
        tail = self.tokenizer.decode(row.tokens[-(self._stop_max_tokens + 2) :])
        return any(s in tail for s in self.cfg.stop)

    def _to_trajectory(self, row: _Row, routes: torch.Tensor | None = None) -> Trajectory:
        traj = finished_trajectory(row.request, row.tokens, row.logprobs, row.versions, row.finish_reason,
                                   self.tokenizer)
        if routes is not None:
            traj.routes = unfed_last(routes)
        if row.forced_at:  # forced close tokens: not sampled, so not trained on (they keep the engine's
            traj.loss_mask = [1] * traj.num_tokens  # version: a response forced throughout still has an age)
            for pos in row.forced_at:
                traj.loss_mask[pos] = 0
        return traj
