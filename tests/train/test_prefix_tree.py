"""Prefix-shared packing: a hand-checked trie layout, and the trie forward equals the padded one
(log-probs, entropies and gradients), alone and through the Trainer."""

import copy
import random

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models.attention import interval_mask
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.prefix_tree import (
    ancestor_mask,
    group_micro_batches,
    pack_prefix_trees,
    subtree_ends,
    trie,
    unpack_trees,
)
from tidal.train.trainer import Trainer

from .test_packing import step_results


def test_trie_shares_every_common_prefix():
    tokens, parents, paths = trie([[1, 5, 6], [1, 5, 7], [1, 5, 6], [2]])
    # nodes: 0:1  1:5(<-0)  2:6(<-1)  3:7(<-1)  4:2 (a second root)
    assert tokens == [1, 5, 6, 7, 2]
    assert parents == [-1, 0, 1, 1, -1]
    assert paths == [[0, 1, 2], [0, 1, 3], [0, 1, 2], [4]]


def test_ancestor_mask_by_hand():
    # one row: 0 <- 1 <- 2, 1 <- 3, then a padding slot (parent -1)
    mask = ancestor_mask(torch.tensor([[-1, 0, 1, 1, -1]]))[0]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0],
                                   [1, 1, 1, 0, 0],
                                   [1, 1, 0, 1, 0],  # node 3 does not see its sibling 2
                                   [0, 0, 0, 0, 1]]


def test_pack_prefix_trees_layout():
    # group 7: [1 5 6], [1 5 8 9]; group 3: [2 4]; capacity 5: group 7's trie (5 nodes) fills row 0
    ids = torch.tensor([[1, 5, 6, 0], [2, 4, 0, 0], [1, 5, 8, 9]])
    packed = pack_prefix_trees(ids, [3, 2, 4], [7, 3, 7], capacity=5)
    assert packed.input_ids_rl.tolist() == [[1, 5, 6, 8, 9], [2, 4, 0, 0, 0]]
    assert packed.position_ids_rl.tolist() == [[0, 1, 2, 2, 3], [0, 1, 0, 0, 0]]
    assert packed.parents_rl.tolist() == [[-1, 0, 1, 1, 3], [-1, 0, -1, -1, -1]]
    assert packed.num_tokens == 7  # of 9 unpacked
    values = torch.arange(10.0).view(2, 5)  # value of node (r, c) = 5r + c
    out = unpack_trees(values, packed, width=4)
    assert out.tolist() == [[0, 1, 2, 0], [0, 6, 0, 0], [0, 1, 3, 4]]  # shared nodes copied to each sequence


def test_a_group_too_large_for_a_row_is_split_and_each_part_repeats_the_shared_prefix():
    ids = torch.tensor([[1, 5, 6, 7], [1, 5, 8, 9], [1, 5, 6, 2]])
    # the group's trie has 7 nodes; capacity 5: rows 0 and 2 (1 5 6 7 / 1 5 6 2: 5 nodes), then row 1 alone
    packed = pack_prefix_trees(ids, [4, 4, 4], [0, 0, 0], capacity=5)
    assert sorted(packed.input_ids_rl.tolist()) == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 0]]
    assert packed.num_tokens == 9
    values = torch.zeros(2, 5)
    row = 0 if packed.input_ids_rl[0, 2] == 6 else 1
    values[row] = torch.tensor([10.0, 11, 12, 13, 14])
    values[1 - row] = torch.tensor([20.0, 21, 22, 23, 0])
    assert unpack_trees(values, packed, width=4).tolist() == [[0, 11, 12, 13], [0, 21, 22, 23], [0, 11, 12, 14]]


def test_group_micro_batches_keep_groups_whole_within_the_node_budget():
    ids = torch.tensor([[1, 5, 6, 0], [2, 4, 0, 0], [1, 5, 8, 9], [3, 3, 3, 0]])
    # tries: group 7 (rows 0, 2) has 5 nodes, group 3 (row 1) 2, group 4 (row 3) 3; budget 5, FFD:
    # [group 7], then group 4 opens a row and group 3 joins it
    assert group_micro_batches(ids, [3, 2, 4, 3], [7, 3, 7, 4], budget=5) == [[0, 2], [1, 3]]


def _batch(lengths, groups, prompt_len, seed=0):
    """Right-padded sequences: each group shares a prompt, and some samples share response prefixes."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    prompts = {k: torch.randint(3, 40, (prompt_len,), generator=g) for k in set(groups)}
    for i, (n, k) in enumerate(zip(lengths, groups)):
        ids[i, :prompt_len] = prompts[k]
        ids[i, prompt_len:n] = torch.randint(3, 6, (n - prompt_len,), generator=g)  # few symbols: prefixes repeat
    return ids


def test_trie_logprobs_equal_padded_values_entropies_and_gradients(small_model):
    model = copy.deepcopy(small_model)
    lengths, groups = [9, 12, 9, 7, 11, 10, 9], [0, 0, 0, 0, 1, 1, 1]
    ids = _batch(lengths, groups, prompt_len=6)
    ids[2] = ids[0]  # an identical pair: one path, two sequences
    attn = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * attn

    padded, ent_padded = token_logprobs(model, ids, attn, temperature=0.7, with_entropy=True)
    (padded * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    packed = pack_prefix_trees(ids, lengths, groups, capacity=64)
    assert packed.num_tokens < sum(lengths) - 2 * 5  # at least the two repeated prompts are shared
    logp, ent = token_logprobs(model, packed.input_ids_rl, packed.attention_mask_r1ll, temperature=0.7,
                               with_entropy=True, position_ids=packed.position_ids_rl, parents_bt=packed.parents_rl)
    got = unpack_trees(logp, packed, ids.shape[1])
    (got * weights).sum().backward()
    assert torch.allclose(got * attn, padded * attn, atol=1e-5)
    assert torch.allclose(unpack_trees(ent, packed, ids.shape[1]) * attn, ent_padded * attn, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5, rtol=1e-4), n


def test_flash_attention_is_refused_with_a_clear_error(small_model):
    model = copy.deepcopy(small_model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="share_prefixes"):
        Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig(share_prefixes=True))


def test_the_trie_is_in_pre_order_and_keeps_input_order_paths():
    # creation order would put e (under a) after c and d; pre-order puts it right after a's subtree so far
    tokens, parents, paths = trie([[9, 1, 2], [9, 3, 4], [9, 1, 5]])
    assert tokens == [9, 1, 2, 5, 3, 4] and parents == [-1, 0, 1, 1, 0, 4]
    assert paths == [[0, 1, 2], [0, 4, 5], [0, 1, 3]]
    assert subtree_ends(parents) == [6, 4, 3, 4, 6, 6]


def test_random_tries_are_pre_order_and_their_intervals_are_the_ancestor_mask():
    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randint(0, 2) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 8))]
        tokens, parents, paths = trie(seqs)
        assert len(tokens) == len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})  # one node per prefix
        assert [[tokens[n] for n in path] for path in paths] == seqs
        ends = subtree_ends(parents)
        for node, p in enumerate(parents):  # pre-order: a node lies inside its parent's interval
            assert p < node and (p < 0 or ends[p] >= ends[node])
        parents_rl = torch.tensor([parents + [-1, -1]])  # + two padding slots
        end_rl = torch.tensor([ends + [len(parents) + 1, len(parents) + 2]])
        assert torch.equal(interval_mask(end_rl)[:, 0], ancestor_mask(parents_rl))


def test_packed_trees_intervals_are_the_ancestor_mask():
    lengths, groups = [9, 12, 9, 7, 11, 10, 9], [0, 0, 0, 0, 1, 1, 1]
    packed = pack_prefix_trees(_batch(lengths, groups, prompt_len=6), lengths, groups, capacity=30)
    assert packed.input_ids_rl.shape[0] > 1  # several rows, with padding
    assert torch.equal(packed.attention_mask_r1ll[:, 0], ancestor_mask(packed.parents_rl))


@pytest.mark.parametrize("layout", [dict(share_prefixes=True, pack_tokens=384),
                                    dict(share_prefixes=True, pack_tokens=384, micro_batch_tokens=400)])
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_block_attention_trains_tries_as_the_dense_mask(small_model, layout, advantage):
    """As ``test_packing``'s check, with each group packed as a trie (rows of several blocks)."""
    algo = AlgoConfig(advantage=advantage, skip_zero_adv_groups=False)
    dense = step_results(small_model, layout, "dense", algo)
    block = step_results(small_model, layout, "block", algo)
    assert dense.keys() == block.keys()
    for name in dense:
        torch.testing.assert_close(block[name], dense[name], atol=1e-5, rtol=1e-4, msg=name)
