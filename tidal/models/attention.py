"""Packed attention without an [L, L] mask: one interval rule, a FlexAttention block mask, and a
Hugging Face attention implementation that runs it.

Both packed layouts of the trainer (``train/packing.py``: several sequences per row; ``train/prefix_tree.py``:
each group's sequences as one token trie) reduce to one rule when the nodes of a row are laid out in
depth-first pre-order: a query at column q may attend to the key at column kv exactly when

    kv <= q < end[kv],

where ``end[kv]`` is one past the last column of kv's subtree (the ancestors of q are exactly the
earlier nodes whose subtree still covers q). Plain packing is the case where every tree is a chain:
``end[kv]`` is the end of kv's sequence. A padding slot has ``end[kv] = kv + 1``: it sees only itself,
so no query row is empty (an all-masked row gives NaN). So a row's whole mask is one long tensor
``end_rl`` [R, L] instead of a boolean [R, 1, L, L], which at L = 32k is 1 GiB per row and forces
SDPA's slowest kernel.

FlexAttention (Dong et al. 2024, arXiv 2412.05496) takes a mask as a function ``mask_mod(b, h, q, kv)``
plus a ``BlockMask``: for each 128 x 128 tile, whether it is empty (skipped), full (no mask evaluated) or
partial. ``interval_block_mask`` builds it from the intervals with O((L/128)^2) tensor work: for a query
block [qlo, qhi] and an earlier-or-equal key block, the tile is non-empty iff some key's interval
reaches qlo (max end > qlo), and full iff it lies strictly before the diagonal and every key's
interval covers the whole query block (min end > qhi).

``packed_attention_forward``, registered with transformers' ``AttentionInterface`` as ``tidal_packed``,
takes a ``BlockMask`` as the attention mask: on CUDA it runs compiled ``flex_attention``; on CPU, where
FlexAttention has no backward, a query-chunked SDPA evaluates ``mask_mod`` for one chunk of query rows
at a time (peak O(chunk x L), each chunk recomputed in the backward so no chunk's mask is kept).
Any other mask (a tensor, or None: the rollout engine's prefill and decode) goes to transformers'
own SDPA unchanged, so switching a model with ``use_packed_attention`` changes nothing else.

Sliding-window layers (``models/architecture.py``) add one more term to the rule, over position ids
rather than columns (in a trie a node's position is its depth): ``pos[q] - pos[kv] < window``. Their block
mask keeps the interval rule's tiles, drops the tiles every pair of which is out of the window (smallest
query position minus largest key position >= window) and keeps a tile full only if every pair is inside
it (largest query position minus smallest key position < window), so a long row skips the tiles far
behind the diagonal.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "tidal_packed"
BLOCK_SIZE = 128
"""FlexAttention's default tile (``_DEFAULT_SPARSE_BLOCK_SIZE``), and the CPU path's query chunk."""


def interval_mask(end_rl: torch.Tensor, pos_rl: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """The dense bool [R, 1, L, L] mask of the interval rule: ``mask[r, 0, q, kv] = kv <= q < end[r, kv]``,
    and with a ``window``, ``pos[r, q] - pos[r, kv] < window`` (``pos_rl`` [R, L]: the position ids).
    For the dense path and for tests; quadratic in L."""
    n = end_rl.shape[1]
    cols = torch.arange(n, device=end_rl.device)
    mask = (cols[None, :] <= cols[:, None]) & (cols[:, None] < end_rl[:, None, :])
    if window is not None:
        mask = mask & (pos_rl[:, :, None] - pos_rl[:, None, :] < window)
    return mask[:, None]


def interval_mask_mod(end_rl: torch.Tensor, pos_rl: torch.Tensor | None = None, window: int | None = None):
    """``mask_mod(b, h, q, kv)`` of the interval rule over ``end_rl`` (and ``window`` over ``pos_rl``). Pure
    tensor ops, so it takes FlexAttention's scalar indices and broadcast index tensors alike; q and kv must
    be < end_rl.shape[1]."""

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < end_rl[b, kv])

    def window_mod(b, h, q, kv):
        return (kv <= q) & (q < end_rl[b, kv]) & (pos_rl[b, q] - pos_rl[b, kv] < window)

    return mask_mod if window is None else window_mod


def interval_block_mask(end_rl: torch.Tensor, block_size: int = BLOCK_SIZE, pos_rl: torch.Tensor | None = None,
                        window: int | None = None) -> BlockMask:
    """The exact ``BlockMask`` of the interval rule for ``end_rl`` [R, L] (long), and of ``window`` over the
    position ids ``pos_rl`` [R, L] when given, on its device, without any [L, L] tensor. L need not be a
    multiple of ``block_size``: ``end_rl`` (and ``pos_rl``) are extended with self-only slots so
    ``mask_mod`` never indexes past them, and the mask keeps ``seq_lengths=(L, L)``."""
    r, n = end_rl.shape
    num_blocks = -(-n // block_size)
    tail = torch.arange(n, num_blocks * block_size, device=end_rl.device)
    end_rl = torch.cat([end_rl, (tail + 1).expand(r, -1)], 1)
    end_rkc = end_rl.view(r, num_blocks, block_size)  # per key block, its columns' ends
    q_lo = torch.arange(num_blocks, device=end_rl.device) * block_size
    q_hi = (q_lo + block_size).clamp(max=n) - 1  # the last real query row of each block
    blocks = torch.arange(num_blocks, device=end_rl.device)
    earlier = blocks[None, :] <= blocks[:, None]  # [nq, nk]: key block at or before the query block
    nonempty = earlier & (end_rkc.amax(-1)[:, None, :] > q_lo[None, :, None])  # [R, nq, nk]
    full = (blocks[None, :] < blocks[:, None]) & (end_rkc.amin(-1)[:, None, :] > q_hi[None, :, None])
    if window is not None:  # tile bounds on query minus key position (the tail slots' position 0 only loosens them)
        pos_rl = torch.cat([pos_rl.to(end_rl.device), torch.zeros_like(tail).expand(r, -1)], 1)
        pos_rkc = pos_rl.view(r, num_blocks, block_size)
        lo_rk, hi_rk = pos_rkc.amin(-1), pos_rkc.amax(-1)
        nonempty &= lo_rk[:, :, None] - hi_rk[:, None, :] < window  # some pair may be inside the window
        full &= hi_rk[:, :, None] - lo_rk[:, None, :] < window  # every pair is inside it
    partial_num, partial_idx = _block_lists(nonempty & ~full)
    full_num, full_idx = _block_lists(full)
    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=interval_mask_mod(end_rl, pos_rl, window), seq_lengths=(n, n))


def _block_lists(blocks_rqk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's form of a bool [R, nq, nk] tile set: per query block, how many key blocks
    (int32 [R, 1, nq]) and their indices in increasing order, first (int32 [R, 1, nq, nk])."""
    order = torch.sort(blocks_rqk.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return blocks_rqk.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


@functools.cache
def _compiled_flex():
    """``flex_attention`` compiled once per process (uncompiled it runs a slow reference path)."""
    return torch.compile(flex_attention)


def _chunk_attention(query, key, value, lo: int, mask_mod, scaling, dropout):
    """SDPA of query rows [lo, lo + C) over keys [kv_lo, lo + C), the chunk's mask from ``mask_mod``;
    kv_lo is the first key any of these rows sees (with many short sequences, most keys are skipped)."""
    r, _, c, _ = query.shape
    hi = lo + c
    index = functools.partial(torch.arange, device=query.device)
    # mask_mod on broadcast indices (b, h, q, kv): the chunk's bool [R, 1, C, hi]
    mask = mask_mod(index(r)[:, None, None, None], index(1)[:, None, None, None],
                    index(lo, hi)[None, None, :, None], index(hi)[None, None, None, :])
    kv_lo = int(mask.flatten(0, 2).any(0).to(torch.int8).argmax())
    return torch.nn.functional.scaled_dot_product_attention(
        query, key[:, :, kv_lo:hi], value[:, :, kv_lo:hi], attn_mask=mask[..., kv_lo:], dropout_p=dropout,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


def chunked_sdpa(query, key, value, block_mask: BlockMask, scaling=None, dropout: float = 0.0,
                 chunk: int = BLOCK_SIZE) -> torch.Tensor:
    """Attention [R, H, L, D] under ``block_mask``'s ``mask_mod``, ``chunk`` query rows at a time
    (causal: a chunk needs keys up to its own end only). With a gradient, each chunk runs under
    non-reentrant checkpointing: the backward rebuilds its mask instead of keeping it, so what the
    graph holds is q, k, v and the output, never [L, L]."""
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    outs = []
    for lo in range(0, query.shape[2], chunk):
        args = (query[:, :, lo:lo + chunk], key, value, lo, block_mask.mask_mod, scaling, dropout)
        outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False) if grad else _chunk_attention(*args))
    return torch.cat(outs, 2)


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention signature (query [B, H, L, D], key/value [B, H_kv, L, D]; returns
    ([B, L, H, D], None)). A ``BlockMask``: FlexAttention on CUDA, chunked SDPA elsewhere. Anything
    else: transformers' SDPA."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.device.type == "cuda":
        assert dropout == 0.0, "FlexAttention has no attention dropout: set the model's attention_dropout to 0"
        out = _compiled_flex()(query, key, value, block_mask=attention_mask, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = chunked_sdpa(query, key, value, attention_mask, scaling, dropout, attention_mask.BLOCK_SIZE[0])
    return out.transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a Hugging Face model (or decoder) running SDPA or eager attention to ``tidal_packed``;
    return whether it runs it now. Flash-attention models are left alone: they take packed rows
    without a mask (boundaries from the position ids). The name is not saved in ``config.json``, so
    a checkpoint loads without tidal."""
    if model.config._attn_implementation in ("sdpa", "eager"):
        register()
        model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


@functools.cache
def register() -> None:
    """Register ``tidal_packed`` with transformers, once per process. Not at import: the registries live in
    ``modeling_utils`` and ``masking_utils``, whose import costs 2-3 s that every ``tidal`` command would
    pay. A 2-D padding mask (the engines' prefill) still becomes SDPA's 4-D mask; 4-D masks and BlockMasks
    pass through transformers' mask preprocessing untouched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
