"""Outcome-reward advantage estimators over groups of samples of one prompt.

Every estimator is ``fn(rewards_b, group_ids_b, *, knobs) -> adv_b``: one reward and one group id per
sample (any integers; groups may have different sizes, e.g. after filtering), one advantage per
sample, broadcast over its response tokens by the caller. A sample alone in its group has no
baseline to compare with and gets advantage 0; nothing returns NaN.

Each function carries ``scope``, the set of samples it must see at once:
- ``"group"``: only its own group (any split along group boundaries gives the same result);
- ``"batch"``: the whole training batch (``reinforce_pp`` normalizes over it);
- ``"minibatch"``: call it once per optimizer minibatch (``magistral``, arXiv 2506.10910 sec. 2.1).

One estimator is per token: ``reinforce_pp_token`` takes the response mask (``mask_bt=``) and an
optional per-token KL penalty (``kl_penalty_bt=``) and returns [B, T], which every loss accepts.
"""

from __future__ import annotations

import math

import torch

from tidal.algo import ADVANTAGES


def _group_index(group_ids_b: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse_b, count_g): dense group index of each sample and each group's size."""
    _, inverse_b, count_g = torch.unique(torch.as_tensor(group_ids_b), return_inverse=True, return_counts=True)
    return inverse_b.to(device), count_g.to(device)


def _group_sum(x_b: torch.Tensor, inverse_b: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x_b.dtype, device=x_b.device).index_add_(0, inverse_b, x_b)


def _centred(rewards_b: torch.Tensor, group_ids_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r - group mean, inverse_b, count_g); a sample alone in its group is exactly 0."""
    rewards_b = torch.as_tensor(rewards_b, dtype=torch.get_default_dtype())
    assert rewards_b.dim() == 1, f"rewards must be [B], got shape {tuple(rewards_b.shape)}"
    inverse_b, count_g = _group_index(group_ids_b, rewards_b.device)
    assert inverse_b.shape == rewards_b.shape, f"{inverse_b.numel()} group ids for {rewards_b.numel()} rewards"
    mean_g = _group_sum(rewards_b, inverse_b, len(count_g)) / count_g
    centred_b = torch.where(count_g[inverse_b] > 1, rewards_b - mean_g[inverse_b], torch.zeros_like(rewards_b))
    return centred_b, inverse_b, count_g


def _scope(scope: str):
    def mark(fn):
        fn.scope = scope
        return fn

    return mark


@ADVANTAGES.register("grpo")
@_scope("group")
def grpo(rewards_b: torch.Tensor, group_ids_b: torch.Tensor, *, adv_eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2): A_i = (r_i - mean_g) / (std_g + eps).

    std_g is the unbiased sample std of the group (N - 1 in the denominator), as in TRL and verl
    (``torch.std``). eps = 1e-6 is verl's and slime's (TRL uses 1e-4, AReaL 1e-5); with binary rewards
    the smallest non-zero std of a group of 8 is ~0.35, so the choice moves advantages by < 3e-4.
    A group with zero std (all rewards equal) gets 0."""
    centred_b, inverse_b, count_g = _centred(rewards_b, group_ids_b)
    sq_g = _group_sum(centred_b**2, inverse_b, len(count_g))
    std_g = (sq_g / (count_g - 1).clamp(min=1)).sqrt()
    std_b = std_g[inverse_b]
    return torch.where(std_b > 0, centred_b / (std_b + adv_eps), torch.zeros_like(centred_b))


@ADVANTAGES.register("dr_grpo")
@_scope("group")
def dr_grpo(rewards_b: torch.Tensor, group_ids_b: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783, sec. 3.2): A_i = r_i - mean_g; no std division (it biases updates
    toward questions that are too easy or too hard)."""
    return _centred(rewards_b, group_ids_b)[0]


@ADVANTAGES.register("rloo")
@_scope("group")
def rloo(rewards_b: torch.Tensor, group_ids_b: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740 sec. 3.2): the baseline of
    sample i is the mean of the other samples of its group, A_i = r_i - mean_{j != i} r_j, which
    equals n / (n - 1) * (r_i - mean_g)."""
    centred_b, inverse_b, count_g = _centred(rewards_b, group_ids_b)
    n_b = count_g[inverse_b].to(centred_b.dtype)
    return centred_b * n_b / (n_b - 1).clamp(min=1)


def _batch_whiten(x_b: torch.Tensor, weight_b: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) with weighted (population) mean and variance; 0 when std is 0."""
    weight_b = weight_b / weight_b.sum().clamp(min=torch.finfo(weight_b.dtype).tiny)
    mean = (weight_b * x_b).sum()
    std = (weight_b * (x_b - mean) ** 2).sum().sqrt()
    return (x_b - mean) / (std + eps) if std > 0 else torch.zeros_like(x_b)


@ADVANTAGES.register("reinforce_pp")
@_scope("batch")
def reinforce_pp(
    rewards_b: torch.Tensor,
    group_ids_b: torch.Tensor,
    *,
    adv_eps: float = 1e-6,
    lengths_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al., arXiv 2501.03262, sec. 3): subtract the group mean reward, then
    normalize with the mean and std of those values over the whole batch:
    A_i = (A'_i - mean_batch A') / (std_batch A' + eps),  A'_i = r_i - mean_g.

    The std is the population std (OpenRLHF's). Each sample counts once; with ``lengths_b`` each
    counts once per response token, as OpenRLHF and verl whiten over tokens. Samples alone in their
    group stay at 0 (they have no baseline)."""
    centred_b, inverse_b, count_g = _centred(rewards_b, group_ids_b)
    weight_b = torch.ones_like(centred_b) if lengths_b is None else torch.as_tensor(lengths_b).to(centred_b)
    adv_b = _batch_whiten(centred_b, weight_b, adv_eps)
    return torch.where(count_g[inverse_b] > 1, adv_b, torch.zeros_like(adv_b))


@ADVANTAGES.register("lite_ppo")
@_scope("batch")
def lite_ppo(rewards_b: torch.Tensor, group_ids_b: torch.Tensor, *, adv_eps: float = 1e-6) -> torch.Tensor:
    """Lite PPO's advantage ("Tricks or Traps? A Deep Dive into RL for LLM Reasoning", arXiv 2508.08221):
    group-mean baseline, batch std scale, A_i = (r_i - mean_g) / (std_batch(r) + eps).

    The mean stays per prompt (a group baseline) while the scale is shared by the batch, so a
    near-uniform group (std_g -> 0) is not blown up the way GRPO's per-group std does. std_batch is
    the unbiased std of all rewards in the batch (``torch.std``), as in the authors' ROLL
    (``norm_mean_type=group, norm_std_type=batch``) and in TRL's ``scale_rewards="batch"``, which is
    the same formula (TRL's eps is 1e-4; ROLL's, verl's and this default 1e-6)."""
    centred_b, _, _ = _centred(rewards_b, group_ids_b)
    rewards_b = torch.as_tensor(rewards_b, dtype=centred_b.dtype)
    std = rewards_b.std() if rewards_b.numel() > 1 else rewards_b.new_zeros(())
    return centred_b / (std + adv_eps) if std > 0 else torch.zeros_like(centred_b)


def _require_unit(value: float, key: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {value!r}")


def _discounted_returns(reward_bt: torch.Tensor, valid_bt: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(steps from t to s) r_s over response tokens, a step being one response
    token (an agent episode's observation tokens, outside the mask, neither earn nor discount)."""
    reward_bt = torch.where(valid_bt, reward_bt, 0.0)
    if gamma == 1.0:
        return reward_bt.flip(-1).cumsum(-1).flip(-1)
    returns_bt = torch.empty_like(reward_bt)
    running_b = reward_bt.new_zeros(reward_bt.shape[0])
    for t in reversed(range(reward_bt.shape[1])):
        running_b = torch.where(valid_bt[:, t], reward_bt[:, t] + gamma * running_b, running_b)
        returns_bt[:, t] = running_b
    return returns_bt


@ADVANTAGES.register("reinforce_pp_token")
@_scope("batch")
def reinforce_pp_token(
    rewards_b: torch.Tensor,
    group_ids_b: torch.Tensor,
    *,
    mask_bt: torch.Tensor,
    kl_penalty_bt: torch.Tensor | None = None,
    gamma: float = 1.0,
    rpp_group_baseline: bool = True,
    adv_eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ with token-level returns (Hu et al., arXiv 2501.03262), advantages [B, T]:

        r_t = -kl_penalty_t + [t is the last response token] * r'_i,   G_t = sum_{s >= t} gamma^(s - t) r_s,
        A_t = (G_t - mean_batch G) / (std_batch G + eps)   over every response token of the batch,

    where kl_penalty_t = kl_coef * KL_t against the reference model (the paper's KL_t is k1, log
    pi_old / pi_ref: set ``kl_estimator=k1``; the trainer passes ``kl_reward_penalty_tokens`` when
    ``kl_in_reward``), and r'_i
    is the outcome reward minus its group mean (``rpp_group_baseline``, REINFORCE++-baseline, the
    paper's variant for group sampling and the one ``reinforce_pp`` implements per sequence) or the raw
    reward (plain REINFORCE++, whose baseline is the batch mean alone). Unlike ``reinforce_pp``, a
    token's return holds only the KL of the tokens after it. gamma = 1 as in the paper's advantage and
    OpenRLHF's default; the std is the population std over tokens (OpenRLHF's whitening). Without a
    KL penalty, with gamma = 1 and one token per sequence it equals ``reinforce_pp``. With the group
    baseline a sample alone in its group gets 0. Masked tokens get 0."""
    _require_unit(gamma, "gamma")
    if rpp_group_baseline:
        outcome_b, inverse_b, count_g = _centred(rewards_b, group_ids_b)
    else:
        outcome_b = torch.as_tensor(rewards_b, dtype=torch.get_default_dtype())
    valid_bt = torch.as_tensor(mask_bt).to(outcome_b.device) > 0
    assert valid_bt.shape[0] == outcome_b.shape[0], f"mask has {valid_bt.shape[0]} rows for {outcome_b.numel()} rewards"
    reward_bt = torch.zeros(valid_bt.shape, dtype=outcome_b.dtype, device=outcome_b.device)
    if kl_penalty_bt is not None:
        reward_bt = reward_bt - torch.as_tensor(kl_penalty_bt).to(reward_bt).detach()
    rows_b = valid_bt.any(-1)
    last_b = valid_bt.shape[1] - 1 - valid_bt.flip(-1).to(torch.uint8).argmax(-1)
    reward_bt[rows_b, last_b[rows_b]] += outcome_b[rows_b]
    returns_bt = _discounted_returns(reward_bt, valid_bt, gamma)
    adv_bt = torch.zeros_like(returns_bt)
    if valid_bt.any():
        values = returns_bt[valid_bt]
        mean, std = values.mean(), values.std(unbiased=False)
        if std > 0:
            adv_bt = torch.where(valid_bt, (returns_bt - mean) / (std + adv_eps), 0.0)
    if rpp_group_baseline:
        adv_bt = torch.where((count_g[inverse_b] > 1)[:, None], adv_bt, 0.0)
    return adv_bt


@ADVANTAGES.register("magistral")
@_scope("minibatch")
def magistral(
    rewards_b: torch.Tensor,
    group_ids_b: torch.Tensor,
    *,
    adv_eps: float = 1e-6,
    lengths_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """Magistral (arXiv 2506.10910, sec. 2.1): A_i = r_i - mean_g, then normalized within each
    minibatch, (A_i - mean_mb) / std_mb. The same math as ``reinforce_pp`` on a minibatch; call it
    once per optimizer minibatch (``scope == "minibatch"``)."""
    return reinforce_pp(rewards_b, group_ids_b, adv_eps=adv_eps, lengths_b=lengths_b)


@ADVANTAGES.register("vcpo")
@_scope("group")
def vcpo(
    rewards_b: torch.Tensor,
    group_ids_b: torch.Tensor,
    *,
    seq_is_weight_b: torch.Tensor | None = None,
    grad_sqnorm_b: torch.Tensor | None = None,
    lengths_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """VCPO's off-policy optimal baseline, OPOB (Huang et al., "Stable Asynchrony: Variance-Controlled
    Off-Policy RL for LLMs", arXiv 2602.17616; github.com/mit-han-lab/vcpo):

        A_i = r_i - b_g,   b_g = sum_{j in g} W_j r_j / sum_{j in g} W_j,   W_j = w_j^2 ||grad log pi(tau_j)||^2

    the baseline minimizing the variance of the importance-weighted policy gradient sum_j w_j
    (r_j - b) grad log pi(tau_j). ``seq_is_weight_b`` is w_j, the sequence-level importance ratio
    pi_theta / pi_behav (None: on-policy, w = 1). ``grad_sqnorm_b`` is the per-sequence squared
    gradient norm of log pi(tau_j), which VCPO measures with one backward pass per trajectory; without
    it ``lengths_b`` stands in, ||grad log pi(tau)||^2 proportional to |tau| (the approximation of
    OPO, Hao et al., arXiv 2505.23585 sec. 3); with neither every norm is equal. VCPO computes b per
    group by default (its ``grad_baselining.scope``), not leave-one-out, which this follows."""
    rewards_b = torch.as_tensor(rewards_b, dtype=torch.get_default_dtype())
    inverse_b, count_g = _group_index(group_ids_b, rewards_b.device)
    norm_b = grad_sqnorm_b if grad_sqnorm_b is not None else lengths_b
    weight_b = torch.ones_like(rewards_b) if norm_b is None else torch.as_tensor(norm_b).to(rewards_b)
    if seq_is_weight_b is not None:
        weight_b = weight_b * torch.as_tensor(seq_is_weight_b).to(rewards_b).detach() ** 2
    num_g = _group_sum(weight_b * rewards_b, inverse_b, len(count_g))
    den_g = _group_sum(weight_b, inverse_b, len(count_g))
    plain_mean_g = _group_sum(rewards_b, inverse_b, len(count_g)) / count_g
    # All weights zero in a group (e.g. every ratio underflowed): fall back to the plain group mean.
    baseline_g = torch.where(den_g > 0, num_g / den_g.clamp(min=torch.finfo(den_g.dtype).tiny), plain_mean_g)
    adv_b = rewards_b - baseline_g[inverse_b]
    return torch.where(count_g[inverse_b] > 1, adv_b, torch.zeros_like(adv_b))


def _pass_at_k_advantages(n: int, c: int, k: int, eps: float) -> tuple[float, float]:
    """(advantage of a correct sample, of an incorrect one) in a group of n with c correct, for pass@k."""
    miss = math.comb(n - c, k) / math.comb(n, k)  # chance that k of the n, drawn without replacement, all fail
    mean = 1.0 - miss
    std = math.sqrt(mean * (1.0 - mean))
    if std == 0.0:  # every k-subset passes (n - c < k) or none does (c = 0): nothing to prefer
        return 0.0, 0.0
    # an incorrect sample's expected pass@k: 1 - P(the other k - 1 drawn from the n - 1 all fail)
    neg_value = 1.0 - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if c < n else 0.0
    return (1.0 - mean) / (std + eps), (neg_value - mean) / (std + eps)


@ADVANTAGES.register("pass_at_k")
@_scope("group")
def pass_at_k(
    rewards_b: torch.Tensor, group_ids_b: torch.Tensor, *, passk_k: int = 4, adv_eps: float = 1e-6
) -> torch.Tensor:
    """Pass@k training's analytic advantage (Chen et al., "Pass@k Training for Adaptively Balancing
    Exploration and Exploitation of Large Reasoning Models", arXiv 2508.10751, "analytical derivation";
    reference code github.com/RUCAIBox/Passk_Training). A group of n samples with c correct (binary
    rewards) is scored as the average pass@k of its k-subsets, R = 1 - C(n - c, k) / C(n, k), with std
    sigma = sqrt(R (1 - R)); then

        A_pos = (1 - R) / sigma,      A_neg = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / sigma,

    the expected group reward of the k-subsets containing the sample, minus R, over sigma. A wrong
    answer is punished less when the group's other samples already pass, which keeps exploring. The
    advantages of a group sum to 0; k = 1 is GRPO with the population std. eps is added to sigma (the
    reference code's 1e-6); a group where every or no k-subset passes gets 0. The paper publishes no
    single k (it reports the method robust to k); 4 is tidal's choice. Groups need at least k samples."""
    if not (isinstance(passk_k, int) and passk_k >= 1):
        raise ValueError(f"passk_k must be an integer >= 1, got {passk_k!r}")
    rewards_b = torch.as_tensor(rewards_b, dtype=torch.get_default_dtype())
    binary_b = (rewards_b == 0) | (rewards_b == 1)
    if not binary_b.all():
        raise ValueError(f"pass_at_k needs binary rewards (0 or 1), got {rewards_b[~binary_b][0].item()!r}: for a "
                         "graded reward set algo.advantage=grpo (or start from the quickstart_grpo recipe)")
    inverse_b, count_g = _group_index(group_ids_b, rewards_b.device)
    correct_g = _group_sum(rewards_b, inverse_b, len(count_g)).round().long()
    table = []  # (A_pos, A_neg) per group, on the host: one transfer to the device, not one per group
    for n, c in zip(count_g.tolist(), correct_g.tolist()):
        if 1 < n < passk_k:
            raise ValueError(f"passk_k={passk_k} needs groups of at least {passk_k} samples, got a group of {n}")
        table.append((0.0, 0.0) if n == 1 else _pass_at_k_advantages(n, c, passk_k, adv_eps))  # n = 1: no group
    adv_g = torch.tensor(table, dtype=rewards_b.dtype, device=rewards_b.device).reshape(-1, 2)
    return torch.where(rewards_b == 1, adv_g[inverse_b, 0], adv_g[inverse_b, 1])


def advantage_metrics(adv_b: torch.Tensor, mask_bt: torch.Tensor | None = None) -> dict[str, float]:
    """Summary of a batch of advantages for logging (``algo/adv_*``): over sequences for [B], over the
    response tokens in ``mask_bt`` for token-level [B, T] advantages (padding would pull the mean to 0)."""
    if adv_b.dim() == 2 and mask_bt is not None:
        adv_b = adv_b[mask_bt > 0]
    if adv_b.numel() == 0:
        return {"algo/adv_abs_mean": 0.0}
    return {
        "algo/adv_abs_mean": adv_b.abs().mean().item(),
        "algo/adv_max": adv_b.max().item(),
        "algo/adv_min": adv_b.min().item(),
    }
