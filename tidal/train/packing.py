"""Padding-free sequence packing: several sequences per row, each attending only to itself.

AReaL's dynamic batching (arXiv 2505.24298) and every large RL trainer pack variable-length
sequences end to end instead of padding each to the longest: a padded [B, T] batch of a long-tailed
length distribution is mostly padding, and every linear layer pays for it. Isolation comes from two
things: position ids restart at 0 for every sequence, and attention is block-diagonal causal (a
token sees only earlier tokens of its own sequence). On GPU, varlen flash attention gets the
boundaries from the position ids alone; on CPU (SDPA or eager attention) we pass an explicit boolean
[R, 1, L, L] mask. Each row holds at most ``capacity`` tokens, which bounds the mask and, on CPU,
the quadratic cost of attending within a row.

The trainer's losses work on the padded [B, T] layout; ``unpack`` scatters packed per-token values
back to it, so the loss and its gradients equal the padded computation's (tests pin this).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.train.microbatch import pack_sequences


@dataclass
class PackedRows:
    """``R`` rows of packed sequences. ``where[i] = (row, start, length)`` for input sequence i."""

    input_ids_rl: torch.Tensor  # long [R, L]
    position_ids_rl: torch.Tensor  # long [R, L], restarting at 0 per sequence
    attention_mask_r1ll: torch.Tensor  # bool [R, 1, L, L], block-diagonal causal
    where: list[tuple[int, int, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.where)


def pack(input_ids_bt: torch.Tensor, lengths_b: list[int], capacity: int, pad_id: int = 0) -> PackedRows:
    """Pack the first ``lengths_b[i]`` tokens of each row i of a right-padded batch."""
    rows = pack_sequences(lengths_b, capacity)
    width = max(sum(lengths_b[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    seq = torch.full((len(rows), width), -1, dtype=torch.long)  # which sequence owns each slot
    where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lengths_b)
    for r, row in enumerate(rows):
        start = 0
        for i in sorted(row):  # input order inside a row keeps the layout easy to read
            n = lengths_b[i]
            ids[r, start : start + n] = input_ids_bt[i, :n]
            pos[r, start : start + n] = torch.arange(n)
            seq[r, start : start + n] = i
            where[i] = (r, start, n)
            start += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)
    # Padding slots attend to themselves only: every query row needs one allowed key (no NaN).
    mask = (same & causal) | torch.eye(width, dtype=torch.bool)
    return PackedRows(ids, pos, mask[:, None], where)


def unpack(values_rl: torch.Tensor, packed: PackedRows, width: int) -> torch.Tensor:
    """Per-token values [R, L] of next-token quantities (log-probs, entropies) back to the
    right-padded [B, width] layout; keeps the autograd graph. Position 0 of every sequence stays 0,
    as in the padded computation: nothing in its own sequence predicts it (in a packed row the slot
    before it belongs to another sequence)."""
    b = len(packed.where)
    rows = torch.tensor([r for r, _, n in packed.where for _ in range(1, n)], dtype=torch.long)
    cols = torch.tensor([s + t for _, s, n in packed.where for t in range(1, n)], dtype=torch.long)
    dest_b = torch.tensor([i for i, (_, _, n) in enumerate(packed.where) for _ in range(1, n)], dtype=torch.long)
    dest_t = torch.tensor([t for _, _, n in packed.where for t in range(1, n)], dtype=torch.long)
    out = values_rl.new_zeros((b, width))
    return out.index_put((dest_b, dest_t), values_rl[rows, cols])
