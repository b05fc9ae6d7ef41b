import math

import pytest
import torch

from tidal.algo import (
    CORRECTIONS,
    POLICY_LOSSES,
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


# every rejection knob on (with equal log-probs none of them fires)
ALL_REJECTIONS = {
    "rs_stat": "seq_max_k3",
    "rs_threshold": 0.1,
    "is_veto_threshold": 1e-4,
    "offpolicy_mask_delta": 0.0,
    "adv": t([1.0, -1.0, -0.5]),
    "is_batch_norm": True,
}


def _knobs(name, level, rejections=True):
    kw = {"tis": {"tis_level": level, "tis_floor": 0.5}, "mis": {"mis_level": level}, "reject": {}, "none": {}}[name]
    return {**kw, **ALL_REJECTIONS} if rejections and name != "none" else kw


@pytest.mark.parametrize("name", CORRECTIONS.names())
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("rejections", [False, True])
def test_equal_logps_give_weight_exactly_one(name, level, rejections):
    torch.manual_seed(0)
    logp = -torch.rand(3, 4) * 5
    if name == "reject" and not rejections:  # nothing to reject by: a clear error, not all-ones weights
        with pytest.raises(ValueError, match="needs a criterion"):
            CORRECTIONS[name](logp, logp.clone(), torch.ones(3, 4), **_knobs(name, level, rejections))
        return
    w, _ = CORRECTIONS[name](logp, logp.clone(), torch.ones(3, 4), **_knobs(name, level, rejections))
    assert torch.equal(w, torch.ones(3, 4))


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_weights_carry_no_gradient_and_are_zero_outside_the_mask(name):
    old = torch.tensor([[0.3, -0.2, 5.0], [0.1, 0.0, 0.0], [0.0, 0.2, -0.1]], requires_grad=True)
    behav = torch.tensor([[0.0, 0.0, -math.inf], [0.0, -math.inf, 0.0], [0.0, 0.0, 0.0]])  # padding may be -inf
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    for level in ("token", "sequence", "geometric"):
        w, metrics = CORRECTIONS[name](old, behav, mask, **_knobs(name, level))
        assert not w.requires_grad and torch.isfinite(w).all()
        assert torch.equal(w[mask == 0], torch.zeros(3)), (level, w)
        assert all(v == v for v in metrics.values()), metrics


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


# ---- tis floor, geometric level -------------------------------------------------------------------------


def test_tis_floor_bounds_the_weight_from_below():
    old = t([[LN(0.1), LN(0.5), LN(3.0), 0.0]])
    w, m = CORRECTIONS["tis"](old, torch.zeros(1, 4), torch.ones(1, 4), tis_floor=0.25)  # clip(rho, 0.25, 2)
    assert w[0].tolist() == pytest.approx([0.25, 0.5, 2.0, 1.0])
    assert m["algo/tis_low_frac"] == pytest.approx(1 / 4) and m["algo/tis_frac"] == pytest.approx(1 / 4)


def test_geometric_tis_uses_the_mean_log_ratio_over_response_tokens():
    # row 0: ratios 1.5 and 3 -> geometric mean sqrt(4.5) = 2.12, under C = 5; the padded token does not count.
    # row 1: ratios 4 and 16 -> geometric mean 8, truncated at C = 5 (its product, 64, would be too).
    old = t([[LN(1.5), LN(3.0), 9.0], [LN(4.0), LN(16.0), 9.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, m = CORRECTIONS["tis"](old, torch.zeros(2, 3), mask, tis_level="geometric", tis_cap=5.0)
    assert w.tolist() == [pytest.approx([math.sqrt(4.5), math.sqrt(4.5), 0.0]), pytest.approx([5.0, 5.0, 0.0])]
    assert m["algo/tis_frac"] == pytest.approx(1 / 2)


def test_geometric_mis_rejects_on_a_length_independent_band():
    # verl's geometric band 0.999 / 1.001: the per-token geometric mean of the sequence ratio.
    old = t([[LN(1.0005), LN(1.0005)], [LN(1.01), LN(0.99)], [LN(1.002), LN(1.002)]])
    w, m = CORRECTIONS["mis"](
        old, torch.zeros(3, 2), torch.ones(3, 2), mis_level="geometric", mis_low=0.999, mis_high=1.001
    )
    g1 = math.sqrt(1.01 * 0.99)  # 0.99995: kept although its tokens are 1% off each way
    assert w.tolist() == [pytest.approx([1.0005] * 2), pytest.approx([g1] * 2), [0.0, 0.0]]
    assert m["algo/mis_frac"] == pytest.approx(1 / 3)


# ---- rejections ------------------------------------------------------------------------------------------


def test_token_k3_rejection_drops_single_tokens():
    # k3 = rho - 1 - log rho: rho = 2 -> 1 - ln 2 = 0.307; rho = 0.5 -> ln 2 - 0.5 = 0.193; rho = 1.1 -> 0.0047
    old = t([[LN(2.0), LN(0.5), LN(1.1), LN(2.0)]])
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    w, m = CORRECTIONS["reject"](old, torch.zeros(1, 4), mask, rs_stat="token_k3", rs_threshold=0.2)
    assert w[0].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert m["algo/rs_frac"] == pytest.approx(1 / 3)


def test_sequence_mean_k2_rejection_composes_with_tis_weights():
    # k2 = (log rho)^2 / 2: row 0 log-ratios [0.1, 0.3] -> [0.005, 0.045], mean 0.025 (kept at 0.03);
    # row 1 [0.5, 0.0] -> [0.125, 0], mean 0.0625 (rejected, all of it).
    old = t([[0.1, 0.3], [0.5, 0.0]])
    w, m = CORRECTIONS["tis"](old, torch.zeros(2, 2), torch.ones(2, 2), rs_stat="seq_mean_k2", rs_threshold=0.03)
    assert w.tolist() == [pytest.approx([math.exp(0.1), math.exp(0.3)]), [0.0, 0.0]]
    assert m["algo/rs_frac"] == pytest.approx(1 / 2)


def test_sequence_max_k3_is_trust_region_masking():
    # row 1 has one token with log-ratio 1: its k3 is e - 2 = 0.718 > 0.1, so the max rejects the row,
    # while the row's mean k3, (e - 2) / 3 = 0.239 (plus ~0 for the others), passes a 0.3 bound.
    old = t([[0.01, 0.02, -0.01], [0.0, 1.0, 0.0]])
    mask, behav = torch.ones(2, 3), torch.zeros(2, 3)
    w, m = CORRECTIONS["reject"](old, behav, mask, rs_stat="seq_max_k3", rs_threshold=0.1)
    assert w.tolist() == [[1.0] * 3, [0.0] * 3] and m["algo/rs_frac"] == pytest.approx(1 / 2)
    w, _ = CORRECTIONS["reject"](old, behav, mask, rs_stat="seq_mean_k3", rs_threshold=0.3)
    assert w.tolist() == [[1.0] * 3, [1.0] * 3]


def test_sequence_max_ratio_rejects_a_sequence_with_one_oversampled_token():
    old = t([[LN(1.9), LN(0.1)], [LN(2.5), 0.0], [LN(9.0), 0.0]])
    mask = t([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])  # row 2's large ratio is on a padded token
    w, m = CORRECTIONS["reject"](old, torch.zeros(3, 2), mask, rs_stat="seq_max_ratio", rs_threshold=2.0)
    assert w.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    assert m["algo/rs_frac"] == pytest.approx(1 / 3)


def test_veto_drops_the_whole_sequence_of_a_catastrophic_token():
    # verl's veto: any response token with rho < 1e-4 zeroes its sequence; a padded one does not count.
    old = t([[0.0, LN(1e-5), 0.0], [0.0, 0.1, LN(1e-5)], [LN(1.5), LN(2e-4), 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, m = CORRECTIONS["tis"](old, torch.zeros(3, 3), mask, is_veto_threshold=1e-4)
    assert w.tolist() == [[0.0] * 3, pytest.approx([1.0, math.exp(0.1), 0.0]), pytest.approx([1.5, 2e-4, 1.0])]
    assert m["algo/veto_frac"] == pytest.approx(1 / 3)


def test_offpolicy_sequence_masking_drops_drifted_negative_sequences():
    """DeepSeek-V3.2: drop when A < 0 and mean_t log(pi_behav / pi_old) > delta."""
    behav = t([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    # drift = mean(behav - old): row 0 0.2 (A < 0: dropped), row 1 0.05 (kept), row 2 0.5 but A > 0 (kept),
    # row 3 0.3 with A < 0 only on its second token (token-level advantages): that token is dropped.
    old = behav - t([[0.1, 0.3], [0.05, 0.05], [0.5, 0.5], [0.3, 0.3]])
    adv_b = t([-1.0, -1.0, 2.0, 0.5])
    w, m = CORRECTIONS["reject"](old, behav, torch.ones(4, 2), offpolicy_mask_delta=0.1, adv=adv_b)
    assert w[:3].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert m["algo/opsm_frac"] == pytest.approx(1 / 4)
    adv_bt = t([[-1.0, -1.0], [-1.0, -1.0], [2.0, 2.0], [0.5, -0.5]])
    w, m = CORRECTIONS["tis"](old, behav, torch.ones(4, 2), offpolicy_mask_delta=0.1, adv=adv_bt)
    rho = (old - behav).exp()
    assert torch.allclose(w, torch.tensor([[0.0, 0.0], rho[1].tolist(), rho[2].tolist(), [rho[3, 0].item(), 0.0]]))
    assert m["algo/opsm_frac"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="offpolicy_mask_delta needs the advantages"):
        CORRECTIONS["reject"](old, behav, torch.ones(4, 2), offpolicy_mask_delta=0.1)


def test_batch_normalization_rescales_to_mean_one_counting_rejected_tokens():
    # token TIS: weights [1.5, 2 (capped), 0.5 | 1, 0 (vetoed row)], mask leaves 5 response tokens
    old = t([[LN(1.5), LN(3.0), LN(0.5)], [0.0, LN(1e-6), 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, m = CORRECTIONS["tis"](old, torch.zeros(2, 3), mask, is_veto_threshold=1e-4, is_batch_norm=True)
    mean = (1.5 + 2.0 + 0.5 + 0.0 + 0.0) / 5
    assert w.tolist() == [pytest.approx([1.5 / mean, 2.0 / mean, 0.5 / mean]), [0.0, 0.0, 0.0]]
    assert m["algo/is_norm_factor"] == pytest.approx(mean)
    assert (w * mask).sum() / mask.sum() == pytest.approx(1.0)
    # sequence level: one weight per sequence, the mean over sequences (verl): rows 1.2 and 0.6 -> mean 0.9
    old = t([[LN(1.2), 0.0, 0.0], [LN(0.6), 0.0, 0.0]])
    w, m = CORRECTIONS["mis"](old, torch.zeros(2, 3), mask, is_batch_norm=True)
    assert w.tolist() == [pytest.approx([1.2 / 0.9] * 3), pytest.approx([0.6 / 0.9] * 2 + [0.0])]
    assert m["algo/is_norm_factor"] == pytest.approx(0.9)


BAD_KNOBS = [
    ("tis", {"tis_floor": 1.5}, "tis_floor"),
    ("tis", {"tis_floor": 3.0, "tis_cap": 2.0}, "tis_floor"),
    ("tis", {"tis_cap": 0.0}, "tis_cap"),
    ("tis", {"tis_level": "word"}, "tis_level"),
    ("mis", {"mis_level": "word"}, "mis_level"),
    ("mis", {"mis_low": 1.5}, "mis_low"),
    ("mis", {"mis_high": 0.5}, "mis_high"),
    ("reject", {"rs_stat": "seq_k9"}, "rs_stat"),
    ("reject", {"rs_stat": "seq_mean_k3", "rs_threshold": 0.0}, "rs_threshold"),
    ("reject", {"rs_stat": "seq_max_ratio", "rs_threshold": 0.5}, "rs_threshold"),
    ("tis", {"is_veto_threshold": 2.0}, "is_veto_threshold"),
    ("mis", {"offpolicy_mask_delta": -1.0, "adv": t([1.0])}, "offpolicy_mask_delta"),
    ("reject", {}, "needs a criterion"),
]


@pytest.mark.parametrize("name, knobs, message", BAD_KNOBS, ids=[f"{n}-{m}" for n, _, m in BAD_KNOBS])
def test_a_bad_knob_is_an_error_naming_it(name, knobs, message):
    with pytest.raises(ValueError, match=message):
        CORRECTIONS[name](torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **knobs)


@pytest.mark.parametrize("name", CORRECTIONS.names())
@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_correction_composes_with_every_loss(name, loss):
    """A correction's weight goes into any loss's ``is_weight_bt``: finite loss and gradient, none on
    masked tokens or on tokens the correction rejected."""
    torch.manual_seed(0)
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    behav = -torch.rand(3, 4) * 3
    old = behav + 0.3 * torch.randn(3, 4)
    old[1, 2] = behav[1, 2] + math.log(1e-5)  # row 1 holds a catastrophic token: vetoed
    logp = (old + 0.05 * torch.randn(3, 4)).requires_grad_(True)
    w, _ = CORRECTIONS[name](old, behav, mask, **_knobs(name, "sequence"))
    loss_value, metrics = POLICY_LOSSES[loss](logp, old, t([1.0, -1.0, 0.5]), mask, is_weight_bt=w)
    (grad,) = torch.autograd.grad(loss_value, logp)
    assert torch.isfinite(loss_value) and torch.isfinite(grad).all()
    assert torch.equal(grad[(mask == 0) | (w == 0)], torch.zeros(int(((mask == 0) | (w == 0)).sum())))
    if name != "none":
        assert w[1].eq(0).all()
