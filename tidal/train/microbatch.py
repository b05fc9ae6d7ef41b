"""How a batch of variable-length sequences is cut into units of work of about equal cost.

RL batches are wildly uneven in length (a few long reasoning traces among many short answers), so
how sequences are grouped decides how much compute is wasted on padding and how long the slowest
rank waits. Three pure functions over sequence lengths (no tensors), each returning lists of
indices into ``lengths``:

- ``greedy_collation``: Magistral's greedy collation (arXiv 2506.10910, its infrastructure section:
  19% less padding): sort by length, then fill
  each micro-batch while its padded size (rows x longest row) stays within a token budget. Sorting
  puts similar lengths together, which is what removes most of the padding.
- ``pack_sequences``: first-fit decreasing bin packing of whole sequences into rows of at most
  ``capacity`` tokens, for padding-free packing (``packing.py``); a sequence longer than the
  capacity gets a row of its own.
- ``balanced_partition``: longest-processing-time-first (Graham's LPT, within 4/3 of optimal) split
  of the sequences into ``num_parts`` sets of about equal total length, for data-parallel ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def greedy_collation(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Micro-batches, longest sequences first, each with ``len(mb) * max_len(mb) <= token_budget``
    (a single sequence over the budget forms its own micro-batch)."""
    assert token_budget > 0, f"token_budget must be positive, got {token_budget}"
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Sorted descending: the first row of a micro-batch is its longest, so its padded size
        # after adding i is (rows + 1) * that first length.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pack_sequences(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: rows of whole sequences with ``sum(lengths) <= capacity`` each."""
    assert capacity > 0, f"capacity must be positive, got {capacity}"
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            rows.append([i])
            free.append(capacity - lengths[i])
        else:
            rows[slot].append(i)
            free[slot] -= lengths[i]
    return rows


def balanced_partition(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """LPT: assign sequences, longest first, to the part with the least total so far."""
    assert num_parts > 0, f"num_parts must be positive, got {num_parts}"
    heap = [(0, p) for p in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (total + lengths[i], p))
    return parts


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens a padded layout of ``batches`` computes (rows x longest row, summed)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
