"""PPO with a learned value function: per-token rewards, GAE, the clipped value loss, explained variance.

GRPO-family estimators (``ADVANTAGES``) turn one reward per sequence into one advantage per sequence
from its group. Classic PPO (Schulman et al. 2017, arXiv 1707.06347; for LLMs: InstructGPT, verl's and
OpenRLHF's ``gae``) instead learns a critic V(s_t) of every response prefix and gives each token its own
advantage. Those estimators live in ``VALUE_ADVANTAGES``, a sibling registry, because their signature
differs: ``fn(rewards_b, values_bt, mask_bt, *, knobs) -> (adv_bt, returns_bt)``, per token, plus the
returns the critic regresses on.

Conventions (as verl's and OpenRLHF's critics): ``values_bt[:, t]`` is V of the state *before* the
token at column t (the critic's output at column t - 1, the same alignment as ``logp_bt``); the
sequence's reward arrives at its last response token (``token_rewards``); every other token's reward
is 0. ``mask_bt`` is 1 on the tokens the policy sampled. An agent episode's observation tokens (mask 0
between sampled ones) are not time steps: V and the TD error skip them, so the next state of the last
token of a turn is the first token of the next turn (verl's multi-turn GAE does the same).
"""

from __future__ import annotations

import torch

from tidal.algo import VALUE_ADVANTAGES
from tidal.algo.aggregation import aggregate, masked_mean, zero_outside


def token_rewards(rewards_b: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards: each sequence's scalar reward on its last response token (mask 1), 0 elsewhere.
    A row with no response token gets none."""
    rewards_b = torch.as_tensor(rewards_b).to(mask_bt.dtype if mask_bt.is_floating_point() else torch.float32)
    mask = mask_bt > 0
    width = mask_bt.shape[-1]
    # the last masked column: the largest column index among those with mask 1
    last_b = torch.where(mask, torch.arange(width, device=mask.device), -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=rewards_b.dtype, device=mask.device)
    has = last_b >= 0
    out[has.nonzero().squeeze(-1), last_b[has]] = rewards_b[has]
    return out


def masked_whiten(x_bt: torch.Tensor, mask_bt: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked positions (unbiased std, N - 1, as verl's
    ``masked_whiten``), 0 where the mask is 0 and everywhere when fewer than two positions or no spread."""
    mask = mask_bt > 0
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x_bt)
    mean = x_bt[mask].mean()
    std = x_bt[mask].std(unbiased=True)
    if std == 0:
        return torch.zeros_like(x_bt)
    return torch.where(mask, (x_bt - mean) / (std + eps), torch.zeros_like(x_bt))


@VALUE_ADVANTAGES.register("gae")
def gae(
    rewards_b: torch.Tensor,
    values_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    gae_whiten: bool = True,
    adv_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 16) over each
    sequence's response tokens, with the outcome reward on the last one:

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t)        (V after the last token: 0, the episode ends)
        A_t     = delta_t + gamma lam A_{t+1}  =  sum_l (gamma lam)^l delta_{t+l}
        R_t     = A_t + V(s_t)                            (the lambda-return: the critic's target)

    computed as the lambda-return's own recursion, R_t = r_t + gamma ((1 - lam) V(s_{t+1}) + lam R_{t+1}),
    then A_t = R_t - V(s_t) (the same numbers; this way gamma = lam = 1 gives R_t = r exactly, not r
    up to the rounding of a telescoping sum of values).

    Defaults gamma = lam = 1 are verl's (``algorithm.gamma``/``lam``) and OpenRLHF's for LLM RL: no
    discount over a response, so with the reward at the end A_t = r - V(s_t) and R_t = r (a Monte
    Carlo target; lam < 1 trades that variance for the critic's bias, TRL uses 0.95). ``gae_whiten``
    normalizes A over every response token of the batch (``masked_whiten``), as verl does for GAE;
    the returns are never whitened. Masked positions get A = R = 0. Returns (adv_bt, returns_bt),
    both without gradient."""
    values_bt = values_bt.detach()
    assert values_bt.shape == mask_bt.shape, f"values {tuple(values_bt.shape)} vs mask {tuple(mask_bt.shape)}"
    mask = mask_bt > 0
    r_bt = token_rewards(rewards_b, mask_bt).to(values_bt.dtype)
    returns_bt = torch.zeros_like(values_bt)
    next_value_b = torch.zeros_like(values_bt[:, 0])  # V of the next sampled token's state (0 past the end)
    next_return_b = torch.zeros_like(values_bt[:, 0])
    for t in reversed(range(values_bt.shape[1])):
        return_b = r_bt[:, t] + gamma * ((1 - lam) * next_value_b + lam * next_return_b)
        m = mask[:, t]
        returns_bt[:, t] = torch.where(m, return_b, torch.zeros_like(return_b))
        next_value_b = torch.where(m, values_bt[:, t], next_value_b)  # unmasked columns are skipped
        next_return_b = torch.where(m, return_b, next_return_b)
    adv_bt = torch.where(mask, returns_bt - values_bt, torch.zeros_like(returns_bt))
    if gae_whiten:
        adv_bt = masked_whiten(adv_bt, mask_bt, adv_eps)
    return adv_bt, returns_bt


gae.scope = "batch"  # whitening looks at every token of the batch


def value_loss(
    values_bt: torch.Tensor,
    old_values_bt: torch.Tensor,
    returns_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    value_clip: float | None = 0.5,
    vf_coef: float = 1.0,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    agg_weights_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (the PPO2 baselines form, kept by TRL, verl and OpenRLHF):

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        loss_t = 1/2 max((V - R)^2, (V_clip - R)^2)

    aggregated like a policy loss (``agg``, default ``token_mean``; ``agg_weights_bt`` for gradient
    accumulation), times ``vf_coef``. The max makes the clip pessimistic: a prediction that moved more
    than ``value_clip`` from the value the advantages were computed with (``old_values_bt``) stops
    getting gradient once moving further would lower the loss. ``value_clip`` 0.5 is verl's
    ``critic.cliprange_value`` and OpenRLHF's ``--critic.value_clip`` default (TRL: 0.2); None: the
    plain squared error. ``vf_coef`` 1: verl's and OpenRLHF's critic has its own optimizer, so the
    loss is not summed with the policy's (TRL's 0.1 weighs it inside one shared loss); with AdamW it
    matters only against ``grad_clip`` and ``eps``.

    Metrics: ``critic/value_loss`` (the aggregated 1/2 max(...), before ``vf_coef``), ``critic/clip_frac``
    (tokens where the clipped error was the larger, so the clip was active), ``critic/values_mean``."""
    # padding (mask 0) may hold anything, NaN included: select before any arithmetic, or 0 * NaN reaches the gradient
    values_bt = zero_outside(values_bt, mask_bt)
    old_values_bt = zero_outside(old_values_bt, mask_bt).detach()
    returns_bt = zero_outside(returns_bt, mask_bt).detach()
    err_bt = (values_bt - returns_bt) ** 2
    clipped_bt = err_bt
    if value_clip is not None:
        v_clip_bt = old_values_bt + (values_bt - old_values_bt).clamp(-value_clip, value_clip)
        clipped_bt = (v_clip_bt - returns_bt) ** 2
    loss_bt = 0.5 * torch.maximum(err_bt, clipped_bt)
    loss = aggregate(loss_bt, mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=max_gen_len,
                     weights_bt=agg_weights_bt)
    with torch.no_grad():
        metrics = {"critic/value_loss": loss.item(),
                   "critic/clip_frac": masked_mean((clipped_bt > err_bt).float(), mask_bt).item(),
                   "critic/values_mean": masked_mean(values_bt.detach(), mask_bt).item()}
    return vf_coef * loss, metrics


def explained_variance(values_bt: torch.Tensor, returns_bt: torch.Tensor, mask_bt: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 when V predicts every return, 0 when it does no
    better than their mean, negative when worse (verl's ``critic/vf_explained_var``). 0 when the
    returns (nearly) do not vary, Var(R) <= 1e-8: there is nothing to explain, and dividing by a
    rounding error would log an arbitrarily large negative number."""
    mask = mask_bt > 0
    r, v = returns_bt[mask].double(), values_bt[mask].double()
    var_r = r.var(unbiased=False) if r.numel() else r.new_zeros(())
    if var_r <= 1e-8:
        return 0.0
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
