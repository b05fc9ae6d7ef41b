"""The embedded local engine: batched sampling with a KV cache, interruptible between tokens.

How a batch is generated:
1. Prefill: each distinct prompt is run once (left-padded) and its KV cache is repeated for the
   group's samples (``batch_repeat_interleave``), so a group of N costs one prompt forward.
2. Decode: one forward per step over the unfinished rows; finished rows are dropped from the KV
   cache (``batch_select_indices``) so long-tailed batches do not pay for padding.
3. Interruption (AReaL-style): between two decode steps the engine checks for a pending weight
   update. If there is one it loads the weights, bumps its version, re-prefills every unfinished
   sequence (prompt + tokens so far) under the new weights and continues. Tokens sampled after the
   switch carry the new version; nothing generated is thrown away.

Sampling noise is keyed by (run seed, prompt uid, sample index, position) (see ``sampling.py``), so
an interrupted generation with unchanged weights yields the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from tidal.api import GenRequest
from tidal.rollout.sampling import sample_tokens
from tidal.types import Trajectory
from tidal.utils.seeding import stable_hash


@dataclass
class SamplingConfig:
    """How responses are sampled."""

    temperature: float = 1.0
    """1.0 samples from the policy itself (DAPO/GRPO setups); 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 keeps the full distribution (on-policy log-probs)."""
    max_new_tokens: int = 8
    """Generation length cap; a sample that hits it has finish_reason 'length'."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (EOS always stops)."""
    max_batch_size: int = 512
    """Most sequences decoded in one forward pass."""
    early_stop_run: int | None = None
    """MiniMax-M1's early truncation (arXiv 2506.13585, sec. 4): stop a sample once this many
    consecutive sampled tokens each had probability > ``early_stop_prob`` (finish_reason
    'repetition'); the paper uses 3,000 tokens at 0.99 to cut degenerate repetition loops short.
    None disables it."""
    early_stop_prob: float = 0.99
    """The per-token probability above which a token counts toward ``early_stop_run``."""


@dataclass
class _Row:
    request: GenRequest
    key: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    confident_run: int = 0  # consecutive tokens sampled with probability > early_stop_prob


RequestSource = Callable[[int, bool], "list[GenRequest] | None"]


@dataclass
class _Batch:
    """The running batch's tensors: KV cache [B, H, L, D], attention mask [B, L], the position of
    each row's last token [B], and the logits for each row's next token [B, V]."""

    cache: DynamicCache
    mask: torch.Tensor
    last_pos: torch.Tensor
    logits: torch.Tensor

    def select(self, index: torch.Tensor) -> _Batch:
        self.cache.batch_select_indices(index)
        return _Batch(self.cache, self.mask[index], self.last_pos[index], self.logits[index])

    def trimmed(self) -> _Batch:
        """Drop leading cache columns that no row attends to (left padding of finished rows)."""
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first == 0:
            return self
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        return _Batch(self.cache, self.mask[:, first:], self.last_pos, self.logits)


def _merge(a: _Batch | None, b: _Batch) -> _Batch:
    """Stack two batches into one, left-padding the shorter cache (masked out, never attended)."""
    if a is None:
        return b
    la, lb = a.mask.shape[1], b.mask.shape[1]
    width = max(la, lb)
    pad = lambda t, n: torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t  # noqa: E731  [B,H,L,D] on L
    for layer_a, layer_b in zip(a.cache.layers, b.cache.layers):
        layer_a.keys = torch.cat([pad(layer_a.keys, width - la), pad(layer_b.keys, width - lb)])
        layer_a.values = torch.cat([pad(layer_a.values, width - la), pad(layer_b.values, width - lb)])
    pad_mask = torch.nn.functional.pad
    mask = torch.cat([pad_mask(a.mask, (width - la, 0)), pad_mask(b.mask, (width - lb, 0))])
    return _Batch(a.cache, mask, torch.cat([a.last_pos, b.last_pos]), torch.cat([a.logits, b.logits]))


class LocalEngine:
    """In-process engine on a private copy of a Hugging Face causal LM (see module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: SamplingConfig, seed: int = 0, version: int = 0):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.version = version
        self.eos_id = tokenizer.eos_token_id
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

    # ---- weights ---------------------------------------------------------------------------
    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage new weights; applied at the next interruption point (thread-safe)."""
        with self._lock:
            self._pending = (dict(state_dict), version)

    def _apply_pending_update(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        state_dict, version = pending
        self.model.load_state_dict(state_dict)  # strict: a mismatched checkpoint must fail loudly
        self.version = version
        self.num_weight_updates += 1
        return True

    def stats(self) -> dict[str, float]:
        s = max(self.generate_seconds, 1e-9)
        return {
            "perf/gen_tokens_per_s": self.num_generated_tokens / s,
            "rollout/interruptions": float(self.num_interruptions),
            "rollout/weight_updates": float(self.num_weight_updates),
        }

    # ---- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        """Generate one trajectory per request, in request order."""
        pending = list(requests)
        done: dict[int, Trajectory] = {}
        order = {id(r): i for i, r in enumerate(requests)}
        assert len(order) == len(requests), "pass distinct request objects (one per sample)"

        def source(n: int, block: bool) -> list[GenRequest] | None:
            if not pending:
                return None
            taken, pending[:] = pending[:n], pending[n:]
            return taken

        self.stream(source, lambda r, t: done.__setitem__(order[id(r)], t), greedy=greedy)
        return [done[i] for i in range(len(requests))]

    @torch.no_grad()
    def stream(self, source: RequestSource, on_done: Callable[[GenRequest, Trajectory], None],
               greedy: bool = False) -> None:
        """Continuous batching: decode until ``source`` is exhausted and every row has finished.

        Whenever the running batch has free slots (``max_batch_size`` rows), ``source(n, block)`` is
        asked for up to n more requests (``block`` is True only when nothing is running); it returns
        a list (possibly empty) or None once it will never give more. New rows are prefilled and
        joined to the running batch, so the long tail of one batch overlaps the start of the next.
        Finished trajectories go to ``on_done`` as soon as they finish.
        """
        start = time.perf_counter()
        temperature = 0.0 if greedy else self.cfg.temperature
        rows: list[_Row] = []  # the running batch, aligned with the tensors in ``state``
        state: _Batch | None = None
        exhausted = False
        try:
            while True:
                if self._apply_pending_update() and rows:  # interruption point: re-read under new weights
                    self.num_interruptions += 1
                    state = self._prefill(rows, share_prompts=False)
                free = self.cfg.max_batch_size - len(rows)
                if free > 0 and not exhausted:
                    self.generate_seconds += time.perf_counter() - start
                    new = source(free, not rows)
                    start = time.perf_counter()
                    if new is None:
                        exhausted = True
                    elif new:
                        if self._apply_pending_update() and rows:  # arrived while we waited
                            self.num_interruptions += 1
                            state = self._prefill(rows, share_prompts=False)
                        new_rows = [_Row(r, stable_hash(self.seed, r.prompt.uid, r.sample_index)) for r in new]
                        state = _merge(state, self._prefill(new_rows, share_prompts=True))
                        rows += new_rows
                if not rows:
                    if exhausted:
                        return
                    continue
                rows, state = self._sample_step(rows, state, temperature, on_done)
        finally:
            self.generate_seconds += time.perf_counter() - start

    def _sample_step(self, rows: list[_Row], state: _Batch, temperature: float, on_done) -> tuple[list[_Row], _Batch]:
        """Sample one token for every running row, hand finished rows out, decode the rest one step."""
        keys = torch.tensor([r.key for r in rows], dtype=torch.int64)
        gen_pos = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)
        tokens, logps = sample_tokens(state.logits, keys, gen_pos, temperature, self.cfg.top_p)
        keep: list[int] = []
        for slot, (row, tok, lp) in enumerate(zip(rows, tokens.tolist(), logps.tolist())):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            row.confident_run = row.confident_run + 1 if lp > self._early_stop_logp else 0
            if tok == self.eos_id or self._hit_stop(row):
                row.finish_reason = "stop"
            elif len(row.tokens) >= (row.request.max_new_tokens or self.cfg.max_new_tokens):
                row.finish_reason = "length"
            elif self.cfg.early_stop_run is not None and row.confident_run >= self.cfg.early_stop_run:
                row.finish_reason = "repetition"
            else:
                keep.append(slot)
        self.num_generated_tokens += len(rows)
        for slot in sorted(set(range(len(rows))) - set(keep)):
            on_done(rows[slot].request, self._to_trajectory(rows[slot]))
        if not keep:
            return [], None
        if len(keep) < len(rows):
            state = state.select(torch.tensor(keep))
            tokens = tokens[keep]
        rows = [rows[i] for i in keep]
        mask = torch.cat([state.mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        last_pos = state.last_pos + 1
        logits = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                            past_key_values=state.cache, use_cache=True).logits[:, -1]
        return rows, _Batch(state.cache, mask, last_pos, logits).trimmed()

    def _prefill(self, rows: list[_Row], share_prompts: bool) -> _Batch:
        """Forward prompts (+ tokens so far) of ``rows`` into a fresh left-padded KV cache."""
        if share_prompts:
            # Rows of one group are adjacent and share a prompt: run each distinct prompt once.
            starts = [i for i in range(len(rows))
                      if i == 0 or rows[i].request.prompt_ids != rows[i - 1].request.prompt_ids]
            counts = [b - a for a, b in zip(starts, [*starts[1:], len(rows)])]
            seqs = [list(rows[i].request.prompt_ids) for i in starts]
        else:
            counts = [1] * len(rows)
            seqs = [list(r.request.prompt_ids) + r.tokens for r in rows]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True).logits[:, -1]
        batch = _Batch(cache, mask, positions[:, -1], logits)
        if any(c != 1 for c in counts):
            batch = batch.select(torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts)))
        return batch

    def _hit_stop(self, row: _Row) -> bool:
        if not self._stop_max_tokens:
            return False
        tail = self.tokenizer.decode(row.tokens[-(self._stop_max_tokens + 2) :])
        return any(s in tail for s in self.cfg.stop)

    def _to_trajectory(self, row: _Row) -> Trajectory:
        req = row.request
        return Trajectory(
            prompt_uid=req.prompt.uid,
            sample_index=req.sample_index,
            prompt_ids=list(req.prompt_ids),
            token_ids=row.tokens,
            logprobs=row.logprobs,
            versions=row.versions,
            finish_reason=row.finish_reason or "length",
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
        )
