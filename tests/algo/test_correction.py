import math

import pytest
import torch

from tidal.algo import (
    CORRECTIONS,
    effective_sample_size,
    effective_sample_size_log,
    ess_lr_scale,
    sequence_log_ratio,
)

t = torch.tensor
LN = math.log


def test_token_tis_truncates_each_ratio_at_c():
    old = t([[LN(1.5), LN(3.0), -20.0, 5.0]])
    behav = torch.zeros(1, 4)
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    w, m = CORRECTIONS["tis"](old, behav, mask)  # C = 2
    assert w[0, :3].tolist() == pytest.approx([1.5, 2.0, math.exp(-20)], rel=1e-5)
    assert m["algo/tis_frac"] == pytest.approx(1 / 3)


def test_sequence_tis_truncates_the_product_over_tokens():
    # row 0: 1.5 * 3 = 4.5 -> C = 5 keeps it; row 1: 1.5 * 0.5 = 0.75; row 2: 1000 tokens of +20 (e^20000)
    old = torch.zeros(3, 1000)
    old[0, :2] = t([LN(1.5), LN(3.0)])
    old[1, :2] = t([LN(1.5), LN(0.5)])
    old[2] = 20.0
    mask = torch.zeros(3, 1000)
    mask[:2, :2] = 1.0
    mask[2] = 1.0
    w, m = CORRECTIONS["tis"](old, torch.zeros(3, 1000), mask, tis_level="sequence", tis_cap=5.0)
    assert w[0, 0].item() == pytest.approx(4.5) and w[0, 1].item() == pytest.approx(4.5)
    assert w[1, 0].item() == pytest.approx(0.75)
    assert w[2, 0].item() == pytest.approx(5.0) and torch.isfinite(w).all()
    assert m["algo/tis_frac"] == pytest.approx(1 / 3)


def test_token_mis_keeps_ratios_inside_the_band_and_zeroes_the_rest():
    old = t([[LN(0.4), LN(1.5), LN(3.0), LN(0.5), LN(2.0)]])
    w, m = CORRECTIONS["mis"](old, torch.zeros(1, 5), torch.ones(1, 5), mis_level="token")
    assert w[0].tolist() == pytest.approx([0.0, 1.5, 0.0, 0.5, 2.0])
    assert m["algo/mis_frac"] == pytest.approx(2 / 5)


def test_sequence_mis_drops_whole_sequences_outside_the_band():
    # products: 1.5 * 1.2 = 1.8 (kept), 1.5 * 3 = 4.5 (dropped), e^{-40} (dropped)
    old = t([[LN(1.5), LN(1.2)], [LN(1.5), LN(3.0)], [-20.0, -20.0]])
    w, m = CORRECTIONS["mis"](old, torch.zeros(3, 2), torch.ones(3, 2))
    assert w.tolist() == [pytest.approx([1.8, 1.8]), [0.0, 0.0], [0.0, 0.0]]
    assert m["algo/mis_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("name", CORRECTIONS.names())
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equal_logps_give_weight_exactly_one(name, level):
    torch.manual_seed(0)
    logp = -torch.rand(3, 4) * 5
    kw = {"tis": {"tis_level": level}, "mis": {"mis_level": level}, "none": {}}[name]
    w, _ = CORRECTIONS[name](logp, logp.clone(), torch.ones(3, 4), **kw)
    assert torch.equal(w, torch.ones(3, 4))


def test_weights_carry_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    for name in ("tis", "mis"):
        w, _ = CORRECTIONS[name](old, torch.zeros(1, 2), torch.ones(1, 2))
        assert not w.requires_grad


def test_effective_sample_size_hand_computed():
    assert effective_sample_size(t([1.0, 1.0, 1.0, 1.0])) == 1.0
    assert effective_sample_size(t([1.0, 0.0, 0.0, 0.0])) == 0.25
    assert effective_sample_size(t([1.0, 2.0, 3.0])) == pytest.approx(36 / 42)
    assert effective_sample_size(t([[1.0, 2.0], [3.0, 100.0]]), t([[1, 1], [1, 0]])) == pytest.approx(36 / 42)
    assert effective_sample_size(t([0.0, 0.0])) == 0.0
    assert effective_sample_size(t([5.0]), t([0])) == 1.0


def test_effective_sample_size_from_log_weights_survives_overflow():
    assert effective_sample_size_log(t([LN(1.0), LN(2.0), LN(3.0)])) == pytest.approx(36 / 42)
    # e^{5000} overflows any float; the log form still says one sample dominates
    assert effective_sample_size_log(t([5000.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert effective_sample_size_log(t([7.0, 7.0])) == pytest.approx(1.0)


def test_sequence_log_ratio_sums_response_tokens():
    got = sequence_log_ratio(t([[1.0, 2.0, 9.0]]), t([[0.5, 0.5, 0.0]]), t([[1.0, 1.0, 0.0]]))
    assert got.tolist() == [2.0]


def test_vcpo_ess_lr_scale():
    assert ess_lr_scale(0.25) == 0.5  # sqrt rule, base 1
    assert ess_lr_scale(0.25, ess_lr_rule="linear") == 0.25
    assert ess_lr_scale(0.25, ess_base_ratio=0.5) == pytest.approx(math.sqrt(0.5))
    assert ess_lr_scale(0.9, ess_base_ratio=0.5) == 1.0  # never above the base lr
    assert ess_lr_scale(1.0) == 1.0 and ess_lr_scale(0.0) == 0.0
