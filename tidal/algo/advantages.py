"""Outcome-reward advantage estimators over groups of samples of one prompt.

Every estimator is ``fn(rewards_b, group_ids_b, *, knobs) -> adv_b``: one reward and one group id per
sample (any integers; groups may have different sizes, e.g. after filtering), one advantage per
sample, broadcast over its response tokens by the caller. A sample alone in its group has no
baseline to compare with and gets advantage 0; nothing returns NaN.

Each function carries ``scope``, the set of samples it must see at once:
- ``"group"``: only its own group (any split along group boundaries gives the same result);
- ``"batch"``: the whole training batch (``reinforce_pp`` normalizes over it);
- ``"minibatch"``: call it once per optimizer minibatch (``magistral``, arXiv 2506.10910 sec. 2.1).
"""

from __future__ import annotations

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


def advantage_metrics(adv_b: torch.Tensor) -> dict[str, float]:
    """Summary of a batch of advantages for logging (``algo/adv_*``)."""
    if adv_b.numel() == 0:
        return {"algo/adv_abs_mean": 0.0}
    return {
        "algo/adv_abs_mean": adv_b.abs().mean().item(),
        "algo/adv_max": adv_b.max().item(),
        "algo/adv_min": adv_b.min().item(),
    }
