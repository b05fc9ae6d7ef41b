"""How large the local engine's slot cache must be for a call, decided before its first row joins (issue 51).

Why: grown on demand (doubling rows and columns as they ran out), the slot cache reallocated two or three times
inside a call (8 -> 128 rows, 258 -> 518 -> 1,036 columns on an H200), and with CUDA graphs each reallocation
dropped every recorded decode step, re-recorded in the middle of decoding: an RL step's first generate took 4.12 s
against 2.06 s for the second. The call's requests say what it can need, so the buffers are sized once, up front:

- rows: the most rows that run at once, the call's samples capped at the engine's ``max_batch_size``;
- columns: a row's sequence spans at most its prompt plus its length budget (it feeds every sampled token but
  the last, and a speculative verify step writes its newest token plus at most the drafts its budget leaves,
  ``speculative._draft_budget``); ``num_draft_tokens`` more columns cover rows of different progress lined up on
  one write column (``SlotCache._compact``). That is all a call whose rows all join at once needs: its write
  column never reaches the end, and rolled-back drafts are compacted out before they would (speculative decoding
  stays within plain decoding's width plus a verify step's, docs/speculative.md). When rows join later (more
  samples than slots, or a stream fed over time) the live span moves back to column 0 as the write column reaches
  the end, so ``slots.MOVE_ROOM`` (64) more columns keep a move a copy once per 64 steps, not one every step
  (``SlotCache._place``). Not twice the span, as doubling reached: with CUDA graphs attention reads the whole
  buffer width every step (``graphs.py``; with ``rollout.graph_widths=buckets`` only the write column's width
  bucket), so spare columns cost every step's time, not only memory.

Columns are rounded up to a multiple of ``COLUMN_QUANTUM``: a run's prompts differ in length, and every call whose
longest prompt beat the last would otherwise reallocate (and, with CUDA graphs, record every bucket again) for a
handful of columns. A call never allocates more than this; a later call that fits reuses the buffers as they are
(never shrunk), so a steady caller (the RL step, the async controller) allocates once or a few times. Contexts the
sizing could not know (an agent's longer next turn arriving mid-stream) grow the buffers as before, counted
(``rollout/slot_resizes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.api import GenRequest
from tidal.rollout.slots import MOVE_ROOM

COLUMN_QUANTUM = 64
"""Columns are allocated in multiples of this (see module docstring): at most 63 spare columns per row."""


def slot_shape(requests: Sequence[GenRequest], default_budget: int, max_rows: int, draft_tokens: int,
               joins_later: bool, quantum: int = COLUMN_QUANTUM) -> tuple[int, int]:
    """(rows, columns) for ``requests`` (see module docstring). ``default_budget``: the length budget of a request
    without its own; ``draft_tokens``: speculative decoding's drafts per step (0: off); ``joins_later``: rows may
    join while others run (a stream, or more requests than ``max_rows``); ``quantum``: columns' rounding."""
    rows = min(len(requests), max_rows)
    span = max(len(r.prompt_ids) + (r.max_new_tokens or default_budget) for r in requests)
    moves = joins_later or len(requests) > max_rows
    columns = span + (MOVE_ROOM if moves else 0) + draft_tokens
    return rows, -(-columns // quantum) * quantum
