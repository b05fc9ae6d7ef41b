"""Preference pairs as prefix tries: a pair's chosen and rejected share their prompt, computed once.

DPO and the reward model score a pair's two conversations, and the two start with the same tokens: the
prompt, and often part of the answer too (``what is 12+34?`` -> ``46`` against ``45`` share everything up to
the last digit). Run as two packed sequences, that common prefix goes through the model twice, at the same
positions, giving the same hidden states twice. Here each pair is one token trie of the RL trainer's prefix
sharing (``train/prefix_tree.py``, whose group is the pair): the longest common token prefix laid out once,
the two tails after it as sibling branches, a node attending to its ancestors and itself at its depth as
position. Every node's hidden state is then the one each sequence through it computes alone, so the
log-probs, the rewards and their gradients equal the two-row computation's (``tests/stages/
test_pair_sharing.py`` checks it, with the token count). On the synthetic domain (18-token sequences whose
answers differ in a digit or two) a pair is ~20 tokens instead of ~36.

What the loss counts is unchanged: the log-probs come back in the right-padded [2B, T] layout, one copy per
sequence (``unpack_trees``), and the caller applies the same completion masks as before. The LM head runs
only on the nodes some sequence's mask scores (``token_logprobs``'s ``score_mask_bt``), the prompt's never.

Rows are as wide as costs least (``row_width``), at most ``pack_length``: attention costs each row its width
squared, so short pairs run faster in several narrow rows than in one ``max_length``-wide one (the synthetic
domain's DPO step: ~17% less CPU time at ~46 columns than at 128), while long ones fill wide rows.

A trie is not a varlen flash-attention segment: a model loaded with flash attention (no explicit mask) takes
the two-row packing (``shares_prefixes``), with the same results.
"""

from __future__ import annotations

import itertools

import torch

from tidal.models.logprobs import token_logprobs
from tidal.train.microbatch import pack_sequences
from tidal.train.packing import packed_attention_mask
from tidal.train.prefix_tree import PackedTrees, unpack_trees


def shares_prefixes(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention takes the explicit mask a trie needs (not varlen flash attention)."""
    return not str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("flash")


def pack_pairs(chosen: list[list[int]], rejected: list[list[int]], pack_length: int,
               hidden_size: int = 1024) -> tuple[PackedTrees, list[int]]:
    """One trie per pair (sequences numbered chosen 0..B-1, then rejected 0..B-1, as the two-row path numbers
    them), tries packed into rows of at most ``pack_length`` nodes (or the longest sequence), as wide as costs
    least for a model of ``hidden_size`` (``row_width``); and the sequences' lengths.

    The layout is ``pack_prefix_trees``'s for these groups, node for node (``tests/stages/test_pair_sharing.py``
    compares them), built with tensor ops: a two-sequence trie is known without walking it, in pre-order the
    common prefix (c nodes), the chosen tail, then the rejected tail, so no per-token Python runs each step."""
    ids_bt, lengths = right_padded(chosen + rejected)
    n, width = len(chosen), ids_bt.shape[1]
    length_b = torch.tensor(lengths)
    lc, lr = length_b[:n], length_b[n:]
    within = torch.arange(width)[None] < torch.minimum(lc, lr)[:, None]
    c = ((ids_bt[:n] == ids_bt[n:]) & within).cumprod(1).sum(1)  # each pair's longest common prefix
    size = lc + lr - c  # a two-sequence trie's nodes
    capacity = row_width(size.tolist(), max(pack_length, width), hidden_size)
    rows = pack_sequences(size.tolist(), capacity)
    row_l, offset_l, size_l = [0] * n, [0] * n, size.tolist()
    for r, members in enumerate(rows):  # per pair, never per token: which row, and where in it
        start = 0
        for k in sorted(members):
            row_l[k], offset_l[k], start = r, start, start + size_l[k]
    row_p, offset_p = torch.tensor(row_l, dtype=torch.long), torch.tensor(offset_l, dtype=torch.long)
    # every node: its pair p and index j in the pair's trie; nodes j >= lc[p] are the rejected tail
    pair_n = torch.repeat_interleave(torch.arange(n), size)
    j = torch.arange(int(size.sum())) - (torch.cumsum(size, 0) - size)[pair_n]
    lc_n, c_n, size_n = lc[pair_n], c[pair_n], size[pair_n]
    tail = j >= lc_n
    depth = torch.where(tail, j - lc_n + c_n, j)
    token = torch.where(tail, ids_bt[n + pair_n, depth.clamp(max=width - 1)], ids_bt[pair_n, j.clamp(max=width - 1)])
    parent = torch.where(j == lc_n, c_n - 1, j - 1)  # the rejected tail hangs off the prefix's last node
    end = torch.where((j >= c_n) & ~tail, lc_n, size_n)  # the chosen tail's subtree ends where it does
    row_n, col_n = row_p[pair_n], offset_p[pair_n] + j
    num_rows, num_cols = len(rows), int((offset_p + size).max())
    ids_rl = torch.zeros((num_rows, num_cols), dtype=torch.long)
    pos_rl, parents_rl = torch.zeros_like(ids_rl), torch.full_like(ids_rl, -1)
    end_rl = torch.arange(1, num_cols + 1).repeat(num_rows, 1)  # padding sees itself only
    ids_rl[row_n, col_n], pos_rl[row_n, col_n] = token, depth
    parents_rl[row_n, col_n] = torch.where(parent >= 0, offset_p[pair_n] + parent, -1)
    end_rl[row_n, col_n] = offset_p[pair_n] + end
    # unpack: sequence b's position t (1 <= t < length) reads its pair's node t, or for a rejected position
    # past the prefix, node t - c + lc
    count_b = length_b - 1
    dest_b = torch.repeat_interleave(torch.arange(2 * n), count_b)
    dest_t = torch.arange(int(count_b.sum())) - (torch.cumsum(count_b, 0) - count_b)[dest_b] + 1
    pair_d = dest_b % n
    node_d = torch.where((dest_b >= n) & (dest_t >= c[pair_d]), dest_t - c[pair_d] + lc[pair_d], dest_t)
    layout = PackedTrees(ids_rl, pos_rl, end_rl, parents_rl, row_p[pair_d], offset_p[pair_d] + node_d, dest_b,
                         dest_t, 2 * n, int(size.sum()))
    return layout, lengths


def right_padded(rows: list[list[int]], dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, list[int]]:
    """``sft.padded``'s [B, T] and lengths from one flat tensor (one conversion, not one per row)."""
    lengths = [len(r) for r in rows]
    out = torch.zeros((len(rows), max(lengths)), dtype=dtype)
    out[torch.arange(out.shape[1])[None] < torch.tensor(lengths)[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(rows)), dtype=dtype)
    return out, lengths


def row_width(sizes: list[int], limit: int, hidden_size: int) -> int:
    """The row capacity, between the largest trie and ``limit``, whose first-fit packing of tries of ``sizes``
    nodes costs least. R rows of W columns cost R * W token slots in every linear layer and R * W * W in
    attention; per token, attention's scores and values are ~2 W h multiply-adds against ~16 h^2 for the
    projections and an MLP 4h wide, so a row's cost is taken as R * W * (1 + W / (8 h)). Candidates are the
    multiples of the largest trie (one, two, ... tries a row) and ``limit``."""
    largest = max(sizes)
    best = (float("inf"), limit)
    for capacity in sorted({*range(largest, limit + 1, largest), max(limit, largest)}):
        rows = pack_sequences(sizes, capacity)
        width = max(sum(sizes[i] for i in row) for row in rows)
        best = min(best, (len(rows) * width * (1 + width / (8 * hidden_size)), capacity))
    return best[1]


def _hidden_size(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "hidden_size", 0) or 1024)


def node_mask(layout: PackedTrees, mask_bt: torch.Tensor) -> torch.Tensor:
    """Bool [R, L]: the nodes whose token some sequence's ``mask_bt`` [B, T] counts (a shared node counts if
    either sequence through it does)."""
    hits = torch.zeros(layout.input_ids_rl.shape)
    hits.index_put_((layout.source_rows, layout.source_cols), mask_bt[layout.dest_b, layout.dest_t].float(),
                    accumulate=True)
    return hits > 0


def pair_logprobs(model: torch.nn.Module, chosen: list[list[int]], rejected: list[list[int]], pack_length: int,
                  mask_bt: torch.Tensor, attention: str = "auto") -> tuple[torch.Tensor, int]:
    """(log p(x_t | x_<t) right-padded [2B, T], chosen rows then rejected, nonzero where ``mask_bt`` [2B, T]
    scores; the tokens the forward computed). One packed forward of the pairs' tries."""
    layout, _ = pack_pairs(chosen, rejected, pack_length, _hidden_size(model))
    mask = packed_attention_mask(layout, model, attention)
    logp_rl, _ = token_logprobs(model, layout.input_ids_rl, mask, position_ids=layout.position_ids_rl,
                                parents_bt=layout.parents_rl, score_mask_bt=node_mask(layout, mask_bt))
    return unpack_trees(logp_rl, layout, mask_bt.shape[1]), layout.num_tokens


def last_nodes(layout: PackedTrees, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each sequence's last token's node: where ``unpack_trees`` reads position length - 1.
    Every sequence needs two tokens or more (a pair's prompt and completion have one each)."""
    last_b = torch.tensor(lengths, dtype=torch.long) - 1
    assert bool((last_b >= 1).all()), "a one-token sequence has no entry in the unpack index"
    hit = layout.dest_t == last_b[layout.dest_b]
    rows, cols = torch.empty_like(last_b), torch.empty_like(last_b)
    rows[layout.dest_b[hit]], cols[layout.dest_b[hit]] = layout.source_rows[hit], layout.source_cols[hit]
    return rows, cols


def pair_last_hidden(model: torch.nn.Module, backbone: torch.nn.Module, chosen: list[list[int]],
                     rejected: list[list[int]], pack_length: int) -> tuple[torch.Tensor, int]:
    """(the backbone's last hidden state at each sequence's last token [2B, H], chosen then rejected; the tokens
    the forward computed): what a reward model's head reads, with each pair's common prefix computed once."""
    layout, lengths = pack_pairs(chosen, rejected, pack_length, _hidden_size(model))
    device = next(model.parameters()).device
    hidden_rlh = backbone(input_ids=layout.input_ids_rl.to(device),
                          attention_mask=packed_attention_mask(layout, model, "auto"),
                          position_ids=layout.position_ids_rl.to(device), use_cache=False).last_hidden_state
    rows, cols = last_nodes(layout, lengths)
    return hidden_rlh[rows.to(device), cols.to(device)], layout.num_tokens
