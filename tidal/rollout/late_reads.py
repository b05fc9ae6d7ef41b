"""The local engine's sampled tokens read back one step late, so the host never waits for the device (issue 51).

Why: the synchronous step (``LocalEngine._sample_step``, ``rollout.host_reads=sync``) uploads each row's sampling key
and position, samples, then reads the tokens and log-probs back (``.tolist()``), which waits for the GPU to finish
everything queued, then runs the per-row Python (EOS, stop strings, length budgets) and only then issues the next
decode. The device idles while the host works and the host idles while the device works: on an H200 a 0.5B model's
decode step took ~8 ms where its GPU work is ~1.5 ms. Here (``rollout.host_reads=late``) a step

1. samples every running row's token on the device from its logits, its key and its position, which live on the
   device (``SlotCache.sample_keys`` and ``gen_pos``: set once when a row is admitted, moved with it by every slot
   move, advanced by one on the device each step);
2. copies the tokens and log-probs into a pinned host buffer without blocking and records a CUDA event (on the CPU
   a plain copy, so the CPU tests run this same path);
3. reads the *previous* step's buffer (its event was recorded before the previous decode was queued, so the wait
   covers that step's sampling only) and runs the per-row Python on it: append, finish; finished rows are retired
   and removed from the slots, and this step's tokens, still on the device, follow the slot moves;
4. feeds this step's tokens to the decode straight from the device.

So the host's per-row work of step k overlaps the device's decode of step k. A row found finished one step late has
had one wasted decode step (its last token fed) and one extra token sampled, which is discarded (not appended, no
log-prob). Everything a trajectory holds is the synchronous path's: tokens and log-probs (the noise is keyed by
(request, position), not by schedule: ``sampling.py``), versions (each token keeps the version it was sampled
under), finish reasons, and an MoE model's routes and a kept episode turn, from which the extra fed column is
trimmed (``LocalEngine._retire``). Weight updates and admissions happen between steps and drain the pending step
first (``drain``), so rows' tokens are exact when they are re-read or when the batch changes.

Where a decision on the host must come before the next decode, reads stay synchronous, said once in the log:
speculative decoding (its own step reads drafts and targets), identical-row sharing in a dynamic decode (it needs
the token values to pick the contexts to run; static decode never shares), and budget forcing (a thinking budget
rewrites tokens before they are fed), which switches the rest of a call to the synchronous step when a request with
a budget joins. ``rollout/late_steps`` counts the late steps, ``rollout/decode_step_wait_ms`` the host's mean wait
for the previous step's tokens per late step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tidal.rollout.sampling import sample_tokens

log = logging.getLogger(__name__)

HOST_READS = ("sync", "late")


@dataclass
class _Pending:
    """One step's sampled tokens on their way to the host: the rows they belong to, in slot order when sampled."""

    rows: list
    tokens: torch.Tensor  # host (pinned on CUDA) [>= len(rows)]
    logps: torch.Tensor
    event: torch.cuda.Event | None  # recorded after the copies (CUDA); None on the CPU, where the copy is done
    version: int  # the engine's weights when the step sampled (a weight update may land before it is read)


def late_reads(engine) -> LateReads | None:
    """The engine's late reads for ``rollout.host_reads=late``, or None (``sync``, or a reason why not, logged)."""
    mode = engine.cfg.host_reads
    if mode not in HOST_READS:
        raise ValueError(f"rollout.host_reads={mode!r}: one of {', '.join(HOST_READS)}")
    if mode == "sync":
        return None
    reason = None
    if engine._spec is not None:
        reason = "speculative decoding reads drafts and targets on the host each step"
    elif engine.cfg.share_identical_rows and not engine._static_decode:
        reason = ("rollout.share_identical_rows picks the contexts to run from the token values each step "
                  "(set it false, or decode with static shapes: rollout.cuda_graphs)")
    if reason is not None:
        log.warning("rollout.host_reads=late: the engine reads each step synchronously: %s", reason)
        return None
    return LateReads(engine)


class LateReads:
    """An engine's late reads: its counters and its host buffers; each ``stream`` call reads through its own
    ``begin()`` (two calls may run at once on one engine, each with its own slot cache and pending step)."""

    def __init__(self, engine):
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self._free: list[list] = []  # host buffer pairs of ended calls, reused (pinned allocations are slow)
        self.num_steps = 0  # late steps run
        self.wait_seconds = 0.0  # host time blocked on the previous step's tokens
        self.said_budget = False

    def stats(self) -> dict[str, float]:
        return {"rollout/late_steps": float(self.num_steps),
                "rollout/decode_step_wait_ms": 1e3 * self.wait_seconds / max(self.num_steps, 1)}

    def begin(self) -> LateCall:
        """The late reads of one ``stream`` call; ``end`` it when the call ends."""
        try:
            buffers = self._free.pop()  # atomic: calls may begin on several threads
        except IndexError:
            buffers = self._buffers()
        return LateCall(self, buffers)

    def _buffers(self) -> list:
        """Two (tokens, log-probs, event) host buffers, used in turn: one read while the next is written."""
        size = self.engine.cfg.max_batch_size
        return [(torch.empty(size, dtype=torch.long, pin_memory=self.cuda),
                 torch.empty(size, dtype=torch.float32, pin_memory=self.cuda),
                 torch.cuda.Event() if self.cuda else None) for _ in range(2)]


class LateCall:
    """One call's late step (see module docstring); ``step`` replaces ``LocalEngine._sample_step``."""

    def __init__(self, reads: LateReads, buffers: list):
        self.reads, self.engine, self.buffers = reads, reads.engine, buffers
        self._parity = 0
        self._pending: _Pending | None = None

    def admits(self, requests) -> bool:
        """Whether the late step can run with ``requests`` joining: not with a thinking budget (drain first)."""
        if all(r.thinking_budget is None for r in requests):
            return True
        if not self.reads.said_budget:
            self.reads.said_budget = True
            log.info("rollout.host_reads=late: a request with a thinking budget joined; budget forcing rewrites "
                     "tokens before they are fed, so the rest of this call reads each step synchronously")
        return False

    @torch.no_grad()
    def step(self, rows: list, slots, temperature: float, on_done) -> list:
        """Sample, send the tokens to the host, process the previous step's, retire, decode (module docstring)."""
        e = self.engine
        n = len(rows)
        tokens, logps = sample_tokens(slots.logits[:n], slots.sample_keys[:n], slots.gen_pos[:n], temperature,
                                      e.cfg.top_p)
        slots.gen_pos[:n] += 1
        previous, self._pending = self._pending, self._send(rows, tokens, logps)
        if previous is not None:
            rows, tokens = self._process(previous, rows, slots, on_done, tokens)
        if rows:
            e._decode(rows, slots, tokens)
        self.reads.num_steps += 1
        return rows

    def drain(self, rows: list, slots, on_done) -> list:
        """Process the pending step, if any (before a weight update, an admission, the synchronous step or the
        end of a call): every row's tokens are then exact, and the rows it finished are retired."""
        previous, self._pending = self._pending, None
        if previous is None or not rows:
            return rows
        return self._process(previous, rows, slots, on_done, None)[0]

    def end(self) -> None:
        """The call ended (its rows all finished, or it raised): drop the pending step, give the buffers back. A copy
        still in flight needs no wait: the next call's copies into these buffers queue behind it, and it reads them
        only after its own events."""
        self._pending = None
        self.reads._free.append(self.buffers)

    def _send(self, rows: list, tokens: torch.Tensor, logps: torch.Tensor) -> _Pending:
        """Copy a step's tokens and log-probs to a host buffer, without waiting for the device on CUDA."""
        host_tokens, host_logps, event = self.buffers[self._parity]
        self._parity ^= 1
        n, cuda = len(rows), self.reads.cuda
        host_tokens[:n].copy_(tokens, non_blocking=cuda)
        host_logps[:n].copy_(logps, non_blocking=cuda)
        if event is not None:
            event.record()
        return _Pending(list(rows), host_tokens, host_logps, event, self.engine.version)

    def _process(self, pending: _Pending, rows: list, slots, on_done,
                 tokens: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        """Append ``pending``'s tokens to its rows that are still running (a row retired since sampled this one
        past its end: discarded); retire the rows that finish, ``tokens`` (per running row) following the moves."""
        e = self.engine
        if pending.event is not None:
            began = time.perf_counter()
            pending.event.synchronize()
            self.reads.wait_seconds += time.perf_counter() - began
        n = len(pending.rows)
        finished = appended = 0
        for row, tok, lp in zip(pending.rows, pending.tokens[:n].tolist(), pending.logps[:n].tolist()):
            if row.finish_reason is None:
                appended += 1
                finished += e._append(row, tok, lp, pending.version)
        e.num_generated_tokens += appended
        if not finished:
            return rows, tokens
        keep = torch.tensor([row.finish_reason is None for row in rows], dtype=torch.bool)
        return e._retire(rows, keep, slots, on_done, tokens, fed_last=True)
