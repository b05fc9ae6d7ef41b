import pytest
import torch

from tidal.algo import LOSS_AGGREGATIONS, aggregate, aggregation_weights

t = torch.tensor

# Three sequences: lengths 3, 1, 2; a fourth row with no response token.
LOSS = t([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 7.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = t([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
GROUPS = t([0, 0, 1, 1])

# Token sums per sequence: 6, 4, 12 (the empty row counts for nothing).
HAND = {
    "token_mean": (6 + 4 + 12) / 6,
    "seq_mean_token_mean": (6 / 3 + 4 / 1 + 12 / 2) / 3,
    "seq_mean_token_sum": (6 + 4 + 12) / 3,
    "seq_mean_token_sum_norm": (6 / 4 + 4 / 4 + 12 / 4) / 3,  # no max_gen_len: the width T = 4
    "group_length": ((6 + 4) / (3 + 1) + 12 / 2) / 2,  # Magistral: per group sum / group length, mean
}


@pytest.mark.parametrize("agg", sorted(HAND))
def test_aggregations_hand_computed(agg):
    assert aggregate(LOSS, MASK, agg=agg, group_ids_b=GROUPS).item() == pytest.approx(HAND[agg])


def test_every_registered_aggregation_is_checked_here():
    assert set(LOSS_AGGREGATIONS.names()) == set(HAND)


def test_dr_grpo_normalizes_by_a_constant_generation_budget():
    got = aggregate(LOSS, MASK, agg="seq_mean_token_sum_norm", max_gen_len=10).item()
    assert got == pytest.approx((6 / 10 + 4 / 10 + 12 / 10) / 3)


def test_group_length_weighs_groups_not_tokens():
    # One group [long, short], one group [short]: each group counts once, whatever its length.
    loss, mask = t([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0], [5.0, 0.0, 0.0]]), t([[1.0, 1, 1], [1, 0, 0], [1, 0, 0]])
    got = aggregate(loss, mask, agg="group_length", group_ids_b=t([4, 4, 9])).item()
    assert got == pytest.approx(((1 + 1 + 1 + 3) / 4 + 5 / 1) / 2)
    with pytest.raises(AssertionError, match="group_ids_b"):
        aggregate(loss, mask, agg="group_length")


def test_masked_positions_contribute_no_value_and_no_gradient_even_if_not_finite():
    loss = LOSS.clone()
    loss[MASK == 0] = float("nan")
    loss[0, 3] = float("inf")
    loss.requires_grad_(True)
    for agg in HAND:
        out = aggregate(loss, MASK, agg=agg, group_ids_b=GROUPS)
        assert out.item() == pytest.approx(HAND[agg])
        (grad,) = torch.autograd.grad(out, loss)
        assert torch.equal(grad[MASK == 0], torch.zeros(int((MASK == 0).sum())))


def test_integer_and_bool_masks_are_accepted():
    assert aggregate(LOSS, MASK.long()).item() == pytest.approx(HAND["token_mean"])
    assert aggregate(LOSS, MASK.bool()).item() == pytest.approx(HAND["token_mean"])


@pytest.mark.parametrize("agg", sorted(HAND))
def test_minibatch_losses_with_full_batch_weights_sum_to_the_full_loss(agg):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    groups = t([0, 0, 1, 1, 1, 2])
    full = aggregate(loss, mask, agg=agg, group_ids_b=groups, max_gen_len=8)
    weights = aggregation_weights(mask, agg=agg, group_ids_b=groups, max_gen_len=8)
    # minibatches that split group 1 across them
    parts = [t([0, 2]), t([1, 3, 4]), t([5])]
    total = sum(aggregate(loss[i], mask[i], agg=agg, group_ids_b=groups[i], weights_bt=weights[i]) for i in parts)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose((loss * weights).sum(), full)
