"""Padding-free sequence packing: several sequences per row, each attending only to itself.

AReaL's dynamic batching (arXiv 2505.24298) and every large RL trainer pack variable-length
sequences end to end instead of padding each to the longest: a padded [B, T] batch of a long-tailed
length distribution is mostly padding, and every linear layer pays for it. Isolation comes from two
things: position ids restart at 0 for every sequence, and attention is block-diagonal causal (a
token sees only earlier tokens of its own sequence).

The attention rule is carried as intervals (``models/attention.py``): key column kv is visible to
queries kv <= q < ``end_rl[kv]``, the end of kv's sequence (a padding slot: kv + 1, itself only).
``packed_attention_mask`` turns that into what the model's attention takes: nothing for varlen flash
attention (it finds the boundaries in the position ids), a FlexAttention ``BlockMask`` built from the
intervals (``trainer.packed_attention=block``: no [L, L] tensor, so rows can be long), or the dense
boolean [R, 1, L, L] mask (``dense``: built only when asked for, quadratic in the row length).
Sliding-window layers (Mistral, Gemma 3: ``models/architecture.py``) also need ``pos[q] - pos[kv] < window``
over the restarting position ids, so their layers get a windowed mask of their own.

The trainer's losses work on the padded [B, T] layout; ``unpack`` scatters packed per-token values
back to it, so the loss and its gradients equal the padded computation's (tests pin this).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tidal.models.architecture import attention_layout
from tidal.models.attention import interval_block_mask, interval_mask, use_packed_attention
from tidal.train.microbatch import pack_sequences

PACKED_ATTENTION = ("auto", "dense", "block")


@dataclass
class PackedRows:
    """``R`` rows of packed sequences. ``where[i] = (row, start, length)`` for input sequence i."""

    input_ids_rl: torch.Tensor  # long [R, L]
    position_ids_rl: torch.Tensor  # long [R, L], restarting at 0 per sequence
    end_rl: torch.Tensor  # long [R, L]: one past the last column of each slot's sequence (padding: itself + 1)
    where: list[tuple[int, int, int]]
    source_rows: torch.Tensor  # long [N]: for every (sequence, position >= 1) pair, its row ...
    source_cols: torch.Tensor  # ... and column
    dest_b: torch.Tensor  # long [N]: the pair's sequence ...
    dest_t: torch.Tensor  # ... and position in the right-padded [B, T] layout

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.where)

    @functools.cached_property
    def attention_mask_r1ll(self) -> torch.Tensor:
        """Bool [R, 1, L, L], block-diagonal causal; built on first use (the block path never does)."""
        return interval_mask(self.end_rl)


def pack(input_ids_bt: torch.Tensor, lengths_b: list[int], capacity: int, pad_id: int = 0) -> PackedRows:
    """Pack the first ``lengths_b[i]`` tokens of each row i of a right-padded batch."""
    rows = pack_sequences(lengths_b, capacity)
    width = max(sum(lengths_b[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    # Padding slots attend to themselves only: every query row needs one allowed key (no NaN).
    end = torch.arange(1, width + 1).repeat(len(rows), 1)
    where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lengths_b)
    for r, row in enumerate(rows):
        start = 0
        for i in sorted(row):  # input order inside a row keeps the layout easy to read
            n = lengths_b[i]
            ids[r, start : start + n] = input_ids_bt[i, :n]
            pos[r, start : start + n] = torch.arange(n)
            end[r, start : start + n] = start + n
            where[i] = (r, start, n)
            start += n
    return PackedRows(ids, pos, end, where, *_unpack_index(where))


def _unpack_index(where: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    """Where ``unpack`` reads and writes: (row, column) of every packed token at position >= 1 of
    its sequence, and its (sequence, position), built with tensor ops (this runs every step)."""
    row_b, start_b, length_b = torch.tensor(where, dtype=torch.long).reshape(-1, 3).unbind(1)
    count_b = (length_b - 1).clamp(min=0)  # position 0 has no predecessor in its sequence
    dest_b = torch.repeat_interleave(torch.arange(len(where)), count_b)
    first_b = torch.cumsum(count_b, 0) - count_b  # where each sequence's run starts in the flat index
    dest_t = torch.arange(int(count_b.sum())) - first_b.repeat_interleave(count_b) + 1
    return row_b[dest_b], start_b[dest_b] + dest_t, dest_b, dest_t


def unpack(values_rl: torch.Tensor, packed: PackedRows, width: int) -> torch.Tensor:
    """Per-token values [R, L] of next-token quantities (log-probs, entropies) back to the
    right-padded [B, width] layout; keeps the autograd graph. Position 0 of every sequence stays 0,
    as in the padded computation: nothing in its own sequence predicts it (in a packed row the slot
    before it belongs to another sequence)."""
    out = values_rl.new_zeros((len(packed.where), width))
    return out.index_put((packed.dest_b, packed.dest_t), values_rl[packed.source_rows, packed.source_cols])


def packed_attention_mask(layout, model: torch.nn.Module, mode: str):
    """What ``model``'s attention takes for a packed ``layout`` (``PackedRows`` or ``PackedTrees``,
    both carry ``end_rl`` and ``position_ids_rl``) under ``trainer.packed_attention`` ``mode``: None for
    varlen flash attention; a ``BlockMask`` for ``block`` (``auto`` on CUDA), after switching the model to
    ``tidal_packed`` (``models/attention.py``); else the dense [R, 1, L, L] mask; on the model's device.
    A model with sliding-window layers (``models/architecture.py``) gets its windowed mask too, over the
    position ids (a prepared mask reaches every layer unchanged): a dict keyed by layer type when its
    layers differ (Gemma 3), else the one windowed mask (Mistral)."""
    if str(getattr(model.config, "_attn_implementation", "")).startswith("flash"):
        return None
    device = next(model.parameters()).device
    windows = attention_layout(model.config)
    block = mode == "block" or (mode == "auto" and device.type == "cuda")
    if block and use_packed_attention(model):
        end_rl, pos_rl = layout.end_rl.to(device), layout.position_ids_rl.to(device)
        return windows.build(lambda w: interval_block_mask(end_rl, pos_rl=pos_rl, window=w))
    if not windows.sliding:
        return layout.attention_mask_r1ll.to(device)
    end_rl, pos_rl = layout.end_rl.to(device), layout.position_ids_rl.to(device)
    return windows.build(lambda w: interval_mask(end_rl, pos_rl, w))
