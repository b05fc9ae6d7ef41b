"""Off-policy correction on agent episodes: per-token behaviour log-probs across versions, masked observations.

"Missing Old Logits in Asynchronous Agentic RL" describes corrections that go wrong when an episode's
tokens were sampled by several policy versions and the sampler's log-probs are not kept per token.
tidal keeps them per token, so decoupled PPO's behaviour weight pi_prox / pi_behav is each token's own;
these tests pin that against hand-computed values on one episode row:
    [s0 s1 | o o | s2 s3]  s0, s1 sampled by version 0; s2, s3 by version 1; o = observation tokens.
"""

import math

import torch

from tidal.algo.correction import sequence_log_ratio
from tidal.algo.losses import decoupled_ppo

MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
BEHAV = torch.tensor([[-1.0, -0.5, 0.0, 0.0, -2.0, -0.3]])  # observation tokens: 0.0, as episodes store them
PROX = torch.tensor([[-0.8, -0.7, -5.0, -6.0, -1.9, -0.3]])  # trainer log-probs (observations: anything)


def test_decoupled_ppo_weights_each_token_by_its_own_behaviour_logprob():
    logp = PROX.clone().requires_grad_(True)
    loss, metrics = decoupled_ppo(logp, BEHAV, torch.tensor([1.0]), MASK, prox_logp_bt=PROX)
    w = [math.exp(0.2), math.exp(-0.2), math.exp(0.1), math.exp(0.0)]  # exp(prox - behav), sampled tokens
    assert abs(loss.item() - (-sum(w) / 4)) < 1e-6  # float32: -1.0363261 vs -1.03632608
    loss.backward()
    expected = torch.tensor([[-w[0] / 4, -w[1] / 4, 0.0, 0.0, -w[2] / 4, -w[3] / 4]])
    assert torch.allclose(logp.grad, expected, atol=1e-7)
    assert logp.grad[0, 2:4].eq(0).all(), "observation tokens: zero gradient"
    assert abs(metrics["algo/behav_weight_mean"] - sum(w) / 4) < 1e-6


def test_one_logprob_per_episode_would_give_other_weights():
    """The failure mode tidal avoids: tagging the whole episode with one version's log-probs (here the
    last turn's, as a sampler that keeps only the final request's logits would) changes every weight
    of the earlier turn."""
    last_turn_only = BEHAV.clone()
    last_turn_only[0, :2] = PROX[0, :2]  # earlier tokens "recomputed" instead of kept
    per_token, _ = decoupled_ppo(PROX, BEHAV, torch.tensor([1.0]), MASK, prox_logp_bt=PROX)
    wrong, _ = decoupled_ppo(PROX, last_turn_only, torch.tensor([1.0]), MASK, prox_logp_bt=PROX)
    assert abs(per_token.item() - wrong.item()) > 1e-3


def test_sequence_ratio_of_an_episode_counts_sampled_tokens_only():
    ratio = sequence_log_ratio(PROX, BEHAV, MASK)
    assert torch.allclose(ratio, torch.tensor([0.2 - 0.2 + 0.1 + 0.0]), atol=1e-6)
