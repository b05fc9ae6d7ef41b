"""Micro-batching and padding-free packing: hand-checked layouts, and the packed forward equals the
padded one (values and gradients)."""

import copy

import torch

from tidal.models.logprobs import token_logprobs
from tidal.train.microbatch import balanced_partition, greedy_collation, pack_sequences, padded_tokens
from tidal.train.packing import pack, unpack


def test_greedy_collation_sorts_then_fills_to_the_budget():
    lengths = [5, 50, 7, 48, 6, 20]
    # sorted: 50(1), 48(3), 20(5), 7(2), 6(4), 5(0); budget 100: [50, 48] = 2x50 = 100; then
    # [20, 7, 6, 5] = 4x20 = 80 <= 100
    assert greedy_collation(lengths, 100) == [[1, 3], [5, 2, 4, 0]]
    assert greedy_collation([200, 3], 100) == [[0], [1]]  # an over-long sequence goes alone
    unsorted = [[0, 1], [2, 3], [4, 5]]  # arrival order, two per micro-batch
    assert padded_tokens(lengths, greedy_collation(lengths, 100)) == 180 < padded_tokens(lengths, unsorted)


def test_pack_sequences_first_fit_decreasing():
    # sorted 9(1), 7(3), 5(0), 3(2), 2(4); capacity 10: [9], [7, 3], then 5 opens a row, 2 joins it
    assert pack_sequences([5, 9, 3, 7, 2], 10) == [[1], [3, 2], [0, 4]]
    assert pack_sequences([12], 10) == [[0]]


def test_balanced_partition_is_lpt():
    # LPT on 7,6,5,4,3 into 2: 7->A, 6->B, 5->B(11), 4->A(11), 3->A(14) / B 11
    parts = balanced_partition([7, 6, 5, 4, 3], 2)
    assert sorted(map(sorted, parts)) == [[0, 3, 4], [1, 2]]
    assert sorted(len(p) for p in balanced_partition([1] * 10, 3)) == [3, 3, 4]


def test_pack_layout_and_mask():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    packed = pack(ids, [3, 2, 4], capacity=6)
    # FFD: 4 (seq 2) opens row 0, 3 (seq 0) opens row 1 (4+3 > 6), 2 (seq 1) joins row 0
    assert packed.where == [(1, 0, 3), (0, 0, 2), (0, 2, 4)]
    assert packed.input_ids_rl.tolist() == [[4, 5, 6, 7, 8, 9], [1, 2, 3, 0, 0, 0]]
    assert packed.position_ids_rl.tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 0, 0]]
    m = packed.attention_mask_r1ll[0, 0]
    assert m[3].tolist() == [False, False, True, True, False, False]  # seq 2's 2nd token: itself and its 1st
    assert not m[2, 1] and m[1, 0]  # no attention across the boundary; causal inside
    out = unpack(torch.arange(12.0).view(2, 6), packed, width=5)
    assert out.tolist() == [[0, 7, 8, 0, 0], [0, 1, 0, 0, 0], [0, 3, 4, 5, 0]]  # position 0 stays 0


def test_packed_logprobs_equal_padded_values_and_gradients(small_model):
    model = copy.deepcopy(small_model)
    torch.manual_seed(0)
    lengths = [5, 17, 9, 3, 12]
    ids = torch.zeros(5, 17, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 40, (n,))
    attn = (torch.arange(17)[None] < torch.tensor(lengths)[:, None]).long()
    weights = torch.randn(5, 17) * attn

    model.zero_grad()
    padded, _ = token_logprobs(model, ids, attn)
    (padded * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    packed = pack(ids, lengths, capacity=24)
    assert len(packed.where) == 5 and packed.input_ids_rl.shape[0] < 5
    logp_rl, _ = token_logprobs(model, packed.input_ids_rl, packed.attention_mask_r1ll,
                                position_ids=packed.position_ids_rl)
    got = unpack(logp_rl, packed, width=17)
    (got * weights).sum().backward()
    assert torch.allclose(got * attn, padded * attn, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5, rtol=1e-4), n
