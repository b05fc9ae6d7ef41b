"""Prefix sharing: each group's sequences packed as one token trie, so a common prefix is computed once.

GRPO-family RL samples G responses per prompt, and the trainer then runs the prompt G times: the same
tokens at the same positions, giving the same hidden states G times over. Prefix Grouper (arXiv
2506.05433) computes a group's shared prompt once and attends every response to it. This module goes
one step further and shares every common prefix: a group's sequences become one trie (one node per
distinct prefix), laid out in a packed row. A node attends to its ancestors and itself, and its
position id is its depth, so each node's hidden state equals the one the padded forward computes for
every sequence through it (same tokens, same positions, same causal context). The log-prob of a
token is read from its parent's output (``models/logprobs.py``'s ``parents_bt``), and ``unpack_trees``
gives each sequence its own copy of the values along its path: when several sequences pass through a
node, the gradient of the shared computation is the sum of theirs, as in the padded forward.

On the quickstart (7 prompt tokens, 4 response tokens, 8 samples per prompt) a group is 88 tokens
padded and about 15-40 as a trie, depending on how many samples agree; the forward and backward cost
shrink in proportion. Long prompts and multi-turn episodes that share turns gain more; long,
all-different responses gain little.

Nodes are laid out in depth-first pre-order, so each node's subtree is the run of columns right after
it and "kv is an ancestor of q, or q itself" is the interval test kv <= q < ``end_rl[kv]`` (one past kv's
subtree), the same rule as plain packing (``models/attention.py``, ``train/packing.py``'s
``packed_attention_mask``): a FlexAttention block mask with no [L, L] tensor (``trainer.packed_attention=
block``), or the dense boolean [R, 1, L, L] mask, built only when asked for. Varlen flash attention only
knows contiguous causal segments, so it cannot express a trie. A sliding window counts depth (a node's
position): a node sees the ancestors fewer than ``window`` levels above it, as each sequence through it would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tidal.models.attention import interval_mask
from tidal.train.microbatch import pack_sequences


@dataclass
class PackedTrees:
    """``R`` rows, each holding one or more tries (a group's, or part of a group too large for a row),
    nodes in depth-first pre-order: parents first, each subtree contiguous."""

    input_ids_rl: torch.Tensor  # long [R, L]; padding slots hold pad_id
    position_ids_rl: torch.Tensor  # long [R, L]: each node's depth (its position in every sequence through it)
    end_rl: torch.Tensor  # long [R, L]: one past the last column of each node's subtree (padding: itself + 1)
    parents_rl: torch.Tensor  # long [R, L]: column of each node's parent; -1 for a root or padding
    source_rows: torch.Tensor  # long [N]: for every (sequence, position >= 1) pair, its node's row ...
    source_cols: torch.Tensor  # ... and column
    dest_b: torch.Tensor  # long [N]: the pair's sequence ...
    dest_t: torch.Tensor  # ... and position in the right-padded [B, T] layout
    num_sequences: int
    num_tokens: int  # real (non-padding) nodes: the tokens the forward pays for

    @functools.cached_property
    def attention_mask_r1ll(self) -> torch.Tensor:
        """Bool [R, 1, L, L]: a node sees its ancestors and itself; built on first use (the block path
        never does)."""
        return interval_mask(self.end_rl)


def trie(sequences: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """The token trie of ``sequences``: each node's token and parent (-1 for a root), in depth-first
    pre-order (every parent before its children, each subtree contiguous; siblings in the order they
    first appear), and for every sequence, in input order, the node of each of its tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = []
    child: dict[tuple[int, int], int] = {}
    for seq in sequences:  # creation order first: [p a b], [p c d], [p a e] creates e after c and d
        node, path = -1, []
        for tok in seq:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            path.append(nxt)
            node = nxt
        paths.append(path)
    children: list[list[int]] = [[] for _ in tokens]
    roots: list[int] = []
    for node, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(node)
    order, stack = [], roots[::-1]
    while stack:  # then renumbered in pre-order: the interval form of the ancestor mask needs it
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    new = [0] * len(order)
    for i, node in enumerate(order):
        new[node] = i
    return ([tokens[n] for n in order], [new[parents[n]] if parents[n] >= 0 else -1 for n in order],
            [[new[n] for n in path] for path in paths])


def subtree_ends(parents: list[int]) -> list[int]:
    """One past the last node of each node's subtree, for nodes in pre-order (``trie``): the node's
    index plus its subtree's size, the sizes summed in one reverse pass (children after parents)."""
    size = [1] * len(parents)
    for node in range(len(parents) - 1, -1, -1):
        if parents[node] >= 0:
            size[parents[node]] += size[node]
    return [node + n for node, n in enumerate(size)]


def _groups(group_ids_b: list[int]) -> list[list[int]]:
    """Positions of each group's sequences, groups in order of first appearance."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids_b):
        members.setdefault(int(g), []).append(i)
    return list(members.values())


def group_micro_batches(input_ids_bt: torch.Tensor, lengths_b: list[int], group_ids_b: list[int],
                        budget: int) -> list[list[int]]:
    """Micro-batches of whole groups (a split group would compute its shared prefix twice), filled
    first-fit decreasing to at most ``budget`` trie nodes each (a larger group goes alone)."""
    groups = _groups(group_ids_b)
    ids_list = input_ids_bt.tolist()
    sizes = [len(trie([ids_list[i][: lengths_b[i]] for i in seqs])[0]) for seqs in groups]
    return [sorted(i for k in part for i in groups[k]) for part in pack_sequences(sizes, budget)]


def _fitting_units(sequences: list[list[int]], members: list[int], capacity: int) -> list[tuple[list[int], tuple]]:
    """Split one group into units whose trie fits ``capacity`` nodes, each with its trie: the whole
    group when it fits, else subsets filled first-fit in order. Each unit repeats the prefix it shares
    with the others, so a long group does not force one wide row; a sequence longer than ``capacity``
    is a unit alone."""
    whole = trie(sequences)
    if len(whole[0]) <= capacity:
        return [(members, whole)]
    units: list[list[int]] = []  # positions into ``sequences``; first fit, in order
    for k in range(len(sequences)):
        fits = (u for u in units if len(trie([sequences[c] for c in u] + [sequences[k]])[0]) <= capacity)
        unit = next(fits, None)
        if unit is None:
            units.append([k])
        else:
            unit.append(k)
    return [([members[c] for c in u], trie([sequences[c] for c in u])) for u in units]


def pack_prefix_trees(input_ids_bt: torch.Tensor, lengths_b: list[int], group_ids_b: list[int],
                      capacity: int, pad_id: int = 0) -> PackedTrees:
    """Pack the first ``lengths_b[i]`` tokens of each row of a right-padded batch, one trie per group
    (rows with the same ``group_ids_b``; a group whose trie exceeds ``capacity`` is split into subsets
    that fit), tries placed whole into rows of at most ``capacity`` nodes (first-fit decreasing)."""
    ids_list = input_ids_bt.tolist()
    seq = [ids_list[i][: lengths_b[i]] for i in range(len(lengths_b))]
    tries = [unit for members in _groups(group_ids_b)
             for unit in _fitting_units([seq[i] for i in members], members, capacity)]
    rows = pack_sequences([len(t[0]) for _, t in tries], capacity)
    width = max(sum(len(tries[k][1][0]) for k in row) for row in rows)
    ids, depth, parents, ends = [], [], [], []  # built as lists, one tensor each at the end: this runs every step
    src_r, src_c, dst_b, dst_t = [], [], [], []
    for r, row in enumerate(rows):
        ids_r, depth_r, parents_r, ends_r = [], [], [], []
        for k in sorted(row):  # group order inside a row keeps the layout easy to read
            members, (tokens, pars, paths) = tries[k]
            offset = len(ids_r)
            for tok, p in zip(tokens, pars):
                ids_r.append(tok)
                parents_r.append(offset + p if p >= 0 else -1)
                depth_r.append(depth_r[offset + p] + 1 if p >= 0 else 0)
            ends_r += [offset + e for e in subtree_ends(pars)]
            for i, path in zip(members, paths):  # position 0 has no predecessor: it stays 0, as padded
                src_r += [r] * (len(path) - 1)
                src_c += [offset + node for node in path[1:]]
                dst_b += [i] * (len(path) - 1)
                dst_t += range(1, len(path))
        pad = width - len(ids_r)
        ids.append(ids_r + [pad_id] * pad)
        depth.append(depth_r + [0] * pad)
        parents.append(parents_r + [-1] * pad)
        ends.append(ends_r + list(range(len(ids_r) + 1, width + 1)))  # padding sees itself only
    long = dict(dtype=torch.long)
    return PackedTrees(torch.tensor(ids, **long), torch.tensor(depth, **long), torch.tensor(ends, **long),
                       torch.tensor(parents, **long), torch.tensor(src_r, **long), torch.tensor(src_c, **long),
                       torch.tensor(dst_b, **long), torch.tensor(dst_t, **long), len(lengths_b),
                       sum(len(t[0]) for _, t in tries))


def ancestor_mask(parents_rl: torch.Tensor) -> torch.Tensor:
    """Bool [R, L, L]: ``mask[r, q, k]`` when column k is column q or one of its ancestors, for any
    node order (the reference the interval form is tested against). Built by pointer jumping, one pass
    per tree level; padding slots (parent -1, no children) see themselves only, so no query row is
    empty (an all-masked row would give NaN)."""
    r, n = parents_rl.shape
    mask = torch.eye(n, dtype=torch.bool).expand(r, n, n).clone()
    rows = torch.arange(r)[:, None].expand(r, n)
    queries = torch.arange(n)[None].expand(r, n)
    node = parents_rl
    while bool((node >= 0).any()):
        live = node >= 0
        mask[rows[live], queries[live], node[live]] = True
        node = torch.where(live, parents_rl.gather(1, node.clamp(min=0)), node)
    return mask


def unpack_trees(values_rl: torch.Tensor, packed: PackedTrees, width: int) -> torch.Tensor:
    """Per-node values [R, L] of next-token quantities (log-probs, entropies computed with
    ``parents_bt``) back to the right-padded [B, width] layout, one copy per sequence through each
    node; keeps the autograd graph. Position 0 of every sequence stays 0."""
    out = values_rl.new_zeros((packed.num_sequences, width))
    return out.index_put((packed.dest_b, packed.dest_t), values_rl[packed.source_rows, packed.source_cols])
