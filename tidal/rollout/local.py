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
import threading
import time
from collections.abc import Mapping, Sequence
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


@dataclass
class _Row:
    request: GenRequest
    key: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


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
        self._stop_max_tokens = max((len(tokenizer(s, add_special_tokens=False).input_ids) for s in cfg.stop), default=0)
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
        self.model.load_state_dict(state_dict, strict=False)
        self.version = version
        self.num_weight_updates += 1
        return True

    def stats(self) -> dict[str, float]:
        s = max(self.generate_seconds, 1e-9)
        return {
            "perf/gen_tokens_per_s": self.num_generated_tokens / s,
            "rollout/interruptions": float(self.num_interruptions),
        }

    # ---- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        """Generate one trajectory per request, in request order."""
        start = time.perf_counter()
        out: list[Trajectory] = []
        step = self.cfg.max_batch_size
        for i in range(0, len(requests), step):
            out.extend(self._generate_chunk(requests[i : i + step], greedy))
        self.generate_seconds += time.perf_counter() - start
        return out

    def _prefill(self, rows: list[_Row], active: list[int], share_prompts: bool):
        """Forward prompts (+ tokens so far) of the active rows; returns (cache, mask, positions, logits)."""
        if share_prompts:
            # Rows of one group are adjacent and share a prompt: run each distinct prompt once.
            starts = [i for i in active if i == active[0] or rows[i].request.prompt_ids != rows[i - 1].request.prompt_ids]
            counts = [b - a for a, b in zip(starts, [*starts[1:], active[-1] + 1])]
            seqs = [list(rows[i].request.prompt_ids) for i in starts]
        else:
            seqs = [list(rows[i].request.prompt_ids) + rows[i].tokens for i in active]
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
        last_pos = positions[:, -1]
        if share_prompts and any(c != 1 for c in counts):
            if len(set(counts)) == 1:
                cache.batch_repeat_interleave(counts[0])
            else:
                cache.batch_select_indices(torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts)))
            rep = torch.tensor(counts)
            mask, logits, last_pos = (t.repeat_interleave(rep, dim=0) for t in (mask, logits, last_pos))
        return cache, mask, last_pos, logits

    def _generate_chunk(self, requests: Sequence[GenRequest], greedy: bool) -> list[Trajectory]:
        cfg = self.cfg
        self._apply_pending_update()
        rows = [_Row(r, stable_hash(self.seed, r.prompt.uid, r.sample_index)) for r in requests]
        active = list(range(len(rows)))
        cache, mask, last_pos, logits = self._prefill(rows, active, share_prompts=True)
        temperature = 0.0 if greedy else cfg.temperature
        while active:
            keys = torch.tensor([rows[i].key for i in active], dtype=torch.int64)
            gen_pos = torch.tensor([len(rows[i].tokens) for i in active], dtype=torch.int64)
            tokens, logps = sample_tokens(logits, keys, gen_pos, temperature, cfg.top_p)
            still: list[int] = []
            keep_slots: list[int] = []
            for slot, (i, tok, lp) in enumerate(zip(active, tokens.tolist(), logps.tolist())):
                row = rows[i]
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.versions.append(self.version)
                if tok == self.eos_id or self._hit_stop(row):
                    row.finish_reason = "stop"
                elif len(row.tokens) >= cfg.max_new_tokens:
                    row.finish_reason = "length"
                else:
                    still.append(i)
                    keep_slots.append(slot)
            self.num_generated_tokens += len(active)
            if not still:
                break
            if self._apply_pending_update():  # interruption point: re-read under the new weights
                self.num_interruptions += 1
                active = still
                cache, mask, last_pos, logits = self._prefill(rows, active, share_prompts=False)
                continue
            if len(still) < len(active):
                sel = torch.tensor(keep_slots)
                cache.batch_select_indices(sel)
                mask, last_pos, tokens = mask[sel], last_pos[sel], tokens[sel]
            active = still
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            last_pos = last_pos + 1
            logits = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1]
        return [self._to_trajectory(r) for r in rows]

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
