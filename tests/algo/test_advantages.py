import math

import pytest
import torch

from tidal.algo import ADVANTAGES

t = torch.tensor


def _close(a, b, tol=1e-6):
    assert torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=0), f"{a.tolist()} != {b}"


def test_grpo_matches_hand_computed():
    # Group rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 * 0.5^2) / 3) = sqrt(1/3).
    adv = ADVANTAGES["grpo"](t([1.0, 0.0, 0.0, 1.0]), t([0, 0, 0, 0]), adv_eps=0.0)
    s = math.sqrt(1 / 3)
    _close(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])


def test_grpo_default_eps_and_interleaved_groups_of_different_sizes():
    # ids 7 -> rewards [0, 1]: mean 0.5, std sqrt(0.5); ids 3 -> [3, 1, 2]: mean 2, std 1.
    adv = ADVANTAGES["grpo"](t([0.0, 3.0, 1.0, 1.0, 2.0]), t([7, 3, 7, 3, 3]))
    r = 0.5 / (math.sqrt(0.5) + 1e-6)
    _close(adv, [-r, 1 / (1 + 1e-6), r, -1 / (1 + 1e-6), 0.0])


def test_dr_grpo_is_mean_centred_only():
    _close(ADVANTAGES["dr_grpo"](t([1.0, 0.0, 0.0, 0.0]), t([0, 0, 0, 0])), [0.75, -0.25, -0.25, -0.25])


def test_rloo_leaves_one_out_against_a_plain_loop():
    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, 4.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1, 2]
    expected = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [rj for j, (rj, gj) in enumerate(zip(rewards, groups)) if gj == g and j != i]
        expected.append(r - sum(others) / len(others) if others else 0.0)
    assert expected[:2] == [1.0 - 0.5 / 3, 0.0 - 1.5 / 3]  # spot check of the loop itself
    _close(ADVANTAGES["rloo"](t(rewards), t(groups)), expected)


def test_reinforce_pp_centres_per_group_then_whitens_over_the_batch():
    # A' = [0.5, -0.5 | 1, -1, 0]; batch mean 0, population std sqrt(2.5 / 5) = sqrt(0.5).
    adv = ADVANTAGES["reinforce_pp"](t([1.0, 0.0, 3.0, 1.0, 2.0]), t([0, 0, 1, 1, 1]), adv_eps=0.0)
    s = math.sqrt(0.5)
    _close(adv, [0.5 / s, -0.5 / s, 1 / s, -1 / s, 0.0])


def test_reinforce_pp_token_weighted_whitening():
    # A' = [0.5, -0.5, 1, -1] weighted by lengths [1, 3, 2, 2]: mean (0.5 - 1.5 + 2 - 2) / 8 = -0.125.
    centred, lengths = [0.5, -0.5, 1.0, -1.0], [1, 3, 2, 2]
    mean = sum(a * n for a, n in zip(centred, lengths)) / 8
    std = math.sqrt(sum(n * (a - mean) ** 2 for a, n in zip(centred, lengths)) / 8)
    adv = ADVANTAGES["reinforce_pp"](t([1.0, 0.0, 3.0, 1.0]), t([0, 0, 1, 1]), adv_eps=0.0, lengths_b=t(lengths))
    _close(adv, [(a - mean) / std for a in centred])


def test_magistral_is_group_centred_then_minibatch_normalized_and_says_so():
    assert ADVANTAGES["magistral"].scope == "minibatch"
    assert ADVANTAGES["reinforce_pp"].scope == "batch"
    assert {ADVANTAGES[n].scope for n in ("grpo", "dr_grpo", "rloo", "vcpo")} == {"group"}
    adv = ADVANTAGES["magistral"](t([1.0, 0.0, 3.0, 1.0]), t([0, 0, 1, 1]), adv_eps=0.0)
    s = math.sqrt((0.25 + 0.25 + 1 + 1) / 4)
    _close(adv, [0.5 / s, -0.5 / s, 1 / s, -1 / s])


def test_vcpo_baseline_weights_rewards_by_squared_is_ratio_times_gradient_norm():
    # Group 0: w = [2, 1], ||grad||^2 proxy = lengths [1, 3] -> W = [4, 3]; b = (4 * 1 + 3 * 0) / 7.
    # Group 1: w = [1, 1], lengths [2, 2] -> b = plain mean 2.
    adv = ADVANTAGES["vcpo"](
        t([1.0, 0.0, 3.0, 1.0]), t([0, 0, 1, 1]), seq_is_weight_b=t([2.0, 1.0, 1.0, 1.0]), lengths_b=t([1, 3, 2, 2])
    )
    _close(adv, [3 / 7, -4 / 7, 1.0, -1.0])
    # Measured gradient norms take precedence over the length proxy: W = [1 * 1, 1 * 9] -> b = 0.1.
    adv = ADVANTAGES["vcpo"](t([1.0, 0.0]), t([0, 0]), grad_sqnorm_b=t([1.0, 9.0]), lengths_b=t([5, 5]))
    _close(adv, [0.9, -0.1])


def test_vcpo_on_policy_with_equal_norms_is_dr_grpo():
    r, g = t([1.0, 0.0, 0.0, 5.0, 1.0]), t([0, 0, 0, 1, 1])
    _close(ADVANTAGES["vcpo"](r, g), ADVANTAGES["dr_grpo"](r, g))


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_degenerate_groups_give_zero_never_nan(name):
    # group 0 all equal, group 1 a single sample, group 2 informative
    rewards, groups = t([1.0, 1.0, 1.0, 0.7, 0.0, 1.0]), t([0, 0, 0, 1, 2, 2])
    adv = ADVANTAGES[name](rewards, groups)
    assert adv.shape == (6,) and adv.dtype == torch.float32 and torch.isfinite(adv).all()
    _close(adv[:4], [0.0] * 4)
    assert adv[4] < 0 < adv[5]
    _close(ADVANTAGES[name](t([3.0]), t([0])), [0.0])
    _close(ADVANTAGES[name](t([2.0, 2.0]), t([0, 0])), [0.0, 0.0])


@pytest.mark.parametrize("name", [n for n in ADVANTAGES.names() if ADVANTAGES[n].scope == "group"])
def test_group_scoped_estimators_do_not_look_outside_the_group(name):
    rewards, groups = t([1.0, 0.0, 0.5, 4.0, 2.0]), t([0, 0, 0, 1, 1])
    whole = ADVANTAGES[name](rewards, groups)
    _close(whole[:3], ADVANTAGES[name](rewards[:3], groups[:3]))
    perm = t([4, 0, 3, 2, 1])
    _close(ADVANTAGES[name](rewards[perm], groups[perm]), whole[perm])


def test_unknown_estimator_lists_close_matches():
    with pytest.raises(KeyError, match="grpo"):
        ADVANTAGES["gpro"]
