import itertools
import math

import pytest
import torch

from tidal.algo import ADVANTAGES, advantage_metrics

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
    assert {ADVANTAGES[n].scope for n in ("reinforce_pp", "reinforce_pp_token", "lite_ppo")} == {"batch"}
    assert {ADVANTAGES[n].scope for n in ("grpo", "dr_grpo", "rloo", "vcpo", "pass_at_k")} == {"group"}
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


def _call(name, rewards, groups):
    """Any estimator on [B] rewards, returning [B]: a token-level one gets one response token per sample
    (its [B, 1] result squeezed); ``pass_at_k`` gets k = 1, since the test groups have 1 to 3 samples."""
    if name == "reinforce_pp_token":
        return ADVANTAGES[name](rewards, groups, mask_bt=torch.ones(len(rewards), 1))[:, 0]
    if name == "pass_at_k":
        return ADVANTAGES[name](rewards, groups, passk_k=1)
    return ADVANTAGES[name](rewards, groups)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_degenerate_groups_give_zero_never_nan(name):
    # group 0 all equal, group 1 a single sample, group 2 informative (binary rewards: pass_at_k needs them)
    rewards, groups = t([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]), t([0, 0, 0, 1, 2, 2])
    adv = _call(name, rewards, groups)
    assert adv.shape == (6,) and adv.dtype == torch.float32 and torch.isfinite(adv).all()
    _close(adv[:4], [0.0] * 4)
    assert adv[4] < 0 < adv[5]
    _close(_call(name, t([1.0]), t([0])), [0.0])
    _close(_call(name, t([1.0, 1.0]), t([0, 0])), [0.0, 0.0])


@pytest.mark.parametrize("name", [n for n in ADVANTAGES.names() if ADVANTAGES[n].scope == "group"])
def test_group_scoped_estimators_do_not_look_outside_the_group(name):
    rewards, groups = t([1.0, 0.0, 0.5, 4.0, 2.0]), t([0, 0, 0, 1, 1])
    if name == "pass_at_k":
        rewards, groups = t([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]), t([0, 0, 0, 0, 1, 1, 1])
    whole = _call(name, rewards, groups)
    n0 = int((groups == 0).sum())  # group 0 comes first
    _close(whole[:n0], _call(name, rewards[:n0], groups[:n0]))
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(0))
    _close(_call(name, rewards[perm], groups[perm]), whole[perm])


def test_unknown_estimator_lists_close_matches():
    with pytest.raises(KeyError, match="grpo"):
        ADVANTAGES["gpro"]


# ---- pass@k (Chen et al., arXiv 2508.10751) ---------------------------------------------------------------


def test_pass_at_k_hand_computed():
    # n = 5, c = 2, k = 3. R = 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9; sigma = sqrt(0.9 * 0.1) = 0.3.
    # A_pos = (1 - 0.9) / 0.3 = 1/3. A wrong sample is in C(4,2) = 6 subsets, C(2,2) = 1 of them all wrong:
    # A_neg = (1 - 1/6 - 0.9) / 0.3 = -2/9. The group's advantages sum to 2/3 - 3 * 2/9 = 0.
    adv = ADVANTAGES["pass_at_k"](t([0.0, 1.0, 0.0, 0.0, 1.0]), t([0] * 5), passk_k=3, adv_eps=0.0)
    _close(adv, [-2 / 9, 1 / 3, -2 / 9, -2 / 9, 1 / 3])


@pytest.mark.parametrize("n, c, k", [(6, 2, 3), (8, 1, 4), (8, 5, 2), (7, 3, 1), (6, 4, 2)])
def test_pass_at_k_is_the_expected_max_reward_of_the_k_subsets(n, c, k):
    """The analytic advantage against its definition, enumerated: R = mean over the k-subsets of their max
    reward; a sample's value = the mean over the subsets that contain it; A = (value - R) / sqrt(R (1 - R))."""
    rewards = [1.0] * c + [0.0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    best = {s: max(rewards[i] for i in s) for s in subsets}
    mean = sum(best.values()) / len(subsets)
    std = math.sqrt(mean * (1 - mean))
    expected = []
    for i in range(n):
        mine = [best[s] for s in subsets if i in s]
        expected.append((sum(mine) / len(mine) - mean) / std)
    adv = ADVANTAGES["pass_at_k"](t(rewards), t([0] * n), passk_k=k, adv_eps=0.0)
    _close(adv, expected, tol=1e-5)
    assert abs(adv.sum().item()) < 1e-5


def test_pass_at_1_is_grpo_with_the_population_std():
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.0])  # p = 0.4, population std sqrt(0.24)
    s = math.sqrt(0.24)
    adv = ADVANTAGES["pass_at_k"](rewards, t([0] * 5), passk_k=1, adv_eps=0.0)
    _close(adv, [0.6 / s, -0.4 / s, -0.4 / s, 0.6 / s, -0.4 / s])


def test_pass_at_k_without_a_choice_to_make_is_zero():
    # no correct sample; or n - c < k: every k-subset holds a correct one (pass@k is 1 whatever happens)
    _close(ADVANTAGES["pass_at_k"](t([0.0] * 4), t([0] * 4), passk_k=2), [0.0] * 4)
    _close(ADVANTAGES["pass_at_k"](t([1.0, 1.0, 0.0, 0.0]), t([0] * 4), passk_k=3), [0.0] * 4)


def test_pass_at_k_rejects_what_it_cannot_score():
    with pytest.raises(ValueError, match=r"\(0 or 1\), got 0.5: for a graded reward set algo.advantage=grpo"):
        ADVANTAGES["pass_at_k"](t([1.0, 0.5, 0.0, 0.0]), t([0] * 4))
    with pytest.raises(ValueError, match="passk_k=4 needs groups of at least 4"):
        ADVANTAGES["pass_at_k"](t([1.0, 0.0, 0.0]), t([0] * 3))
    with pytest.raises(ValueError, match="passk_k"):
        ADVANTAGES["pass_at_k"](t([1.0, 0.0]), t([0, 0]), passk_k=0)


# ---- Lite PPO / TRL scale_rewards="batch" ---------------------------------------------------------------


def test_lite_ppo_centres_per_group_and_scales_by_the_batch_std():
    # group 0 [1, 0, 0, 1]: mean 0.5; group 1 [1, 1]: mean 1. Batch rewards [1, 0, 0, 1, 1, 1]: mean 2/3,
    # unbiased variance (4 (1/3)^2 + 2 (2/3)^2) / 5 = (4/9 + 8/9) / 5 = 4/15.
    s = math.sqrt(4 / 15)
    adv = ADVANTAGES["lite_ppo"](t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), t([0, 0, 0, 0, 1, 1]), adv_eps=0.0)
    _close(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0])


def test_lite_ppo_does_not_inflate_a_nearly_uniform_group_as_grpo_does():
    rewards, groups = t([1.0, 1.0, 1.0, 0.9, 1.0, 0.0]), t([0, 0, 0, 0, 1, 1])
    grpo, lite = ADVANTAGES["grpo"](rewards, groups), ADVANTAGES["lite_ppo"](rewards, groups)
    assert grpo[3].abs() > 1.0 > 5 * lite[3].abs()  # GRPO: -1.5 for a 0.1 gap; Lite PPO: -0.19
    _close(lite[3], (0.9 - 0.975) / (rewards.std() + 1e-6))


# ---- REINFORCE++ with token-level returns ----------------------------------------------------------------

MASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def _whiten(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / std for v in values]


def test_reinforce_pp_token_folds_the_kl_into_token_returns_then_whitens_over_tokens():
    # rewards [1, 0 | 1], the last sample alone in its group. Group baseline: r' = [0.5, -0.5, 0].
    # token rewards (KL penalty 0.1 per token, r' on the last response token):
    #   row 0: [-0.1, -0.1, 0.4]         returns (gamma = 1): [0.2, 0.3, 0.4]
    #   row 1: [-0.1, -0.6]              returns: [-0.7, -0.6]
    #   row 2: [-0.1, -0.1, -0.1, -0.1]  returns: [-0.4, -0.3, -0.2, -0.1]
    # then whitened over the 9 response tokens (population std); row 2, alone in its group, gets 0.
    returns = [0.2, 0.3, 0.4, -0.7, -0.6, -0.4, -0.3, -0.2, -0.1]
    w = _whiten(returns)
    adv = ADVANTAGES["reinforce_pp_token"](
        t([1.0, 0.0, 1.0]), t([0, 0, 1]), mask_bt=MASK, kl_penalty_bt=0.1 * MASK, adv_eps=0.0
    )
    assert adv.shape == (3, 4)
    _close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0], [0.0] * 4], tol=1e-5)


def test_reinforce_pp_token_plain_variant_discounts_and_keeps_raw_rewards():
    # No group baseline: r' = r. gamma = 0.5, KL penalty 0.2 on every response token.
    #   row 0 [1, 1, 1, 0], r = 1: rewards [-0.2, -0.2, 0.8]; G_2 = 0.8, G_1 = -0.2 + 0.4 = 0.2, G_0 = -0.2 + 0.1 = -0.1
    #   row 1 [1, 1, 0, 0], r = 0: rewards [-0.2, -0.2];      G_1 = -0.2, G_0 = -0.2 - 0.1 = -0.3
    returns = [-0.1, 0.2, 0.8, -0.3, -0.2]
    w = _whiten(returns)
    adv = ADVANTAGES["reinforce_pp_token"](
        t([1.0, 0.0]),
        t([0, 1]),
        mask_bt=MASK[:2],
        kl_penalty_bt=0.2 * MASK[:2],
        gamma=0.5,
        rpp_group_baseline=False,
        adv_eps=0.0,
    )
    _close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]], tol=1e-5)


def test_reinforce_pp_token_discount_skips_observation_tokens():
    # an agent episode [s, o, o, s]: observation tokens neither earn nor count as a step.
    # r' = [1, -1] (group of two, rewards 2 and 0), gamma = 0.5, no KL:
    #   row 0 [1, 0, 0, 1]: G_3 = 1, G_0 = 0.5 * 1 = 0.5;  row 1 [1, 1, 0, 0]: G_1 = -1, G_0 = -0.5
    mask = t([[1, 0, 0, 1], [1, 1, 0, 0]])
    w = _whiten([0.5, 1.0, -0.5, -1.0])
    adv = ADVANTAGES["reinforce_pp_token"](t([2.0, 0.0]), t([0, 0]), mask_bt=mask, gamma=0.5, adv_eps=0.0)
    _close(adv, [[w[0], 0.0, 0.0, w[1]], [w[2], w[3], 0.0, 0.0]], tol=1e-5)


def test_reinforce_pp_token_without_kl_on_one_token_is_reinforce_pp():
    rewards, groups = t([1.0, 0.0, 3.0, 1.0, 2.0]), t([0, 0, 1, 1, 1])
    token = ADVANTAGES["reinforce_pp_token"](rewards, groups, mask_bt=torch.ones(5, 1), gamma=0.3)
    _close(token[:, 0], ADVANTAGES["reinforce_pp"](rewards, groups))


def test_reinforce_pp_token_rejects_a_discount_outside_the_unit_interval():
    with pytest.raises(ValueError, match="gamma"):
        ADVANTAGES["reinforce_pp_token"](t([1.0, 0.0]), t([0, 0]), mask_bt=torch.ones(2, 1), gamma=1.5)


def test_advantage_metrics_of_token_level_advantages_count_response_tokens_only():
    adv_bt, mask_bt = t([[2.0, -1.0, 0.0], [-4.0, 0.0, 0.0]]), t([[1, 1, 0], [1, 0, 0]])
    m = advantage_metrics(adv_bt, mask_bt)
    assert (m["algo/adv_abs_mean"], m["algo/adv_max"], m["algo/adv_min"]) == (pytest.approx(7 / 3), 2.0, -4.0)
    assert advantage_metrics(t([1.0, -3.0]), mask_bt)["algo/adv_abs_mean"] == 2.0  # [B]: one per sequence
