"""Micro-batching and padding-free packing: hand-checked layouts, and the packed forward equals the
padded one (values and gradients)."""

import copy

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig, validate
from tidal.train.critic import CriticConfig
from tidal.train.microbatch import balanced_partition, greedy_collation, pack_sequences, padded_tokens
from tidal.train.packing import pack, packed_attention_mask, unpack
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch


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


def test_unpack_indices_by_hand():
    packed = pack(torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [3, 0, 0, 0]]), [3, 2, 4, 1], capacity=6)
    # FFD: seq 2 (4) opens row 0, seq 0 (3) row 1, seq 1 (2) joins row 0, seq 3 (1) row 1; input order in a row
    assert packed.where == [(1, 0, 3), (0, 0, 2), (0, 2, 4), (1, 3, 1)]
    assert packed.end_rl.tolist() == [[2, 2, 6, 6, 6, 6], [3, 3, 3, 4, 5, 6]]  # padding (row 1, cols 4-5): itself
    # a one-token sequence (seq 3) has nothing to unpack: nothing in it predicts its only token
    assert packed.dest_b.tolist() == [0, 0, 1, 2, 2, 2] and packed.dest_t.tolist() == [1, 2, 1, 1, 2, 3]
    assert packed.source_rows.tolist() == [1, 1, 0, 0, 0, 0] and packed.source_cols.tolist() == [1, 2, 1, 3, 4, 5]


# ---- packed_attention=block (no [L, L] mask) against dense ---------------------------------------------

def long_batch(seed: int = 0) -> TrainBatch:
    """Three groups of four sequences of 20-128 tokens sharing a 24-token prompt per group, responses over
    three symbols (so tries share response prefixes too): rows of a few hundred tokens span several
    128-token attention blocks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(30, 129, (12,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, 6, (12, width), generator=g)
    group = torch.arange(12) // 4
    ids[:, :24] = torch.randint(3, 40, (3, 24), generator=g)[group]
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attn.float()
    loss_mask[:, :24] = 0
    behav = -torch.rand(12, width, generator=g) * loss_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.0])
    return TrainBatch(ids * attn, attn, loss_mask, behav, torch.where(loss_mask > 0, 0, -1), group, rewards)


def step_results(model, layout: dict, packed_attention: str, algo: AlgoConfig) -> dict[str, torch.Tensor]:
    """Policy (and critic) parameters after one trainer step with ``layout``, and the step's log-probs."""
    model = copy.deepcopy(model)
    optim = OptimConfig(lr=1e-3, grad_clip=1e9)
    trainer = Trainer(model, algo, optim, TrainerConfig(packed_attention=packed_attention, **layout),
                      critic=CriticConfig(optim=optim))
    if trainer.critic is not None:  # a non-zero value head, so the critic's backbone gets gradients
        torch.nn.init.normal_(trainer.critic.model.head.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    trainer.step(long_batch())
    out = {"logp": trainer.last_logp_bt, **dict(model.named_parameters())}
    if trainer.critic is not None:
        out.update({f"critic.{n}": p for n, p in trainer.critic.model.named_parameters()})
    return out


@pytest.mark.parametrize("layout", [dict(packing=True, pack_tokens=384),
                                    dict(packing=True, pack_tokens=384, micro_batch_tokens=600)])
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_block_attention_trains_as_the_dense_mask(small_model, layout, advantage):
    """A trainer step (policy and, with gae, critic) with rows of 3 blocks gives the same log-probs and
    updated weights with the block path (chunked SDPA on CPU) as with the dense [R, 1, L, L] mask."""
    algo = AlgoConfig(advantage=advantage, skip_zero_adv_groups=False)
    dense = step_results(small_model, layout, "dense", algo)
    block = step_results(small_model, layout, "block", algo)
    assert dense.keys() == block.keys() and any(k.startswith("critic.") for k in dense) == (advantage == "gae")
    for name in dense:
        torch.testing.assert_close(block[name], dense[name], atol=1e-5, rtol=1e-4, msg=name)
    q_proj = dict(small_model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(block["model.layers.0.self_attn.q_proj.weight"], q_proj)  # the step moved the weights
    if advantage == "gae":  # and the critic's backbone (a copy of the policy's decoder)
        assert not torch.equal(block["critic.decoder.layers.0.self_attn.q_proj.weight"], q_proj)


def test_auto_is_dense_on_cpu_and_block_builds_no_dense_mask(small_model):
    batch = long_batch()
    packed = pack(batch.input_ids_bt, batch.attention_mask_bt.sum(-1).tolist(), capacity=384)
    model = copy.deepcopy(small_model)
    assert isinstance(packed_attention_mask(packed, model, "auto"), torch.Tensor)
    assert model.config._attn_implementation == "sdpa"  # untouched on the dense path
    packed = pack(batch.input_ids_bt, batch.attention_mask_bt.sum(-1).tolist(), capacity=384)
    mask = packed_attention_mask(packed, model, "block")
    assert isinstance(mask, BlockMask) and model.config._attn_implementation == "tidal_packed"
    with torch.no_grad():
        token_logprobs(model, packed.input_ids_rl, mask, position_ids=packed.position_ids_rl)
    assert "attention_mask_r1ll" not in vars(packed)  # the lazy dense mask was never built


def test_an_unknown_packed_attention_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.packed_attention"):
        validate(TrainerConfig(packed_attention="flex"))
