import math

import torch

from tidal.algo import LOSS_AGGREGATIONS, POLICY_LOSSES
from tidal.algo.config import AlgoConfig

ppo = POLICY_LOSSES.get("ppo_clip")


def _loss(logp, behav, adv, cfg=None):
    t = lambda x: torch.tensor([x])
    return ppo(t(logp), t(behav), t(adv), torch.ones(1, len(logp)), cfg or AlgoConfig())


def test_ppo_clip_decoupled_range_hand_computed():
    # ratios e^{0.5}=1.6487 (A=+1: clipped at 1+0.28), e^{-0.5}=0.6065 (A=+1: unclipped, min picks r*A),
    # e^{0.1}=1.1052 (A=-2: inside range), e^{-0.5} (A=-1: clipped at 1-0.2 -> loss = 0.8).
    loss, m = _loss([0.5, -0.5, 0.1, -0.5], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -2.0, -1.0])
    expected = [-1.28, -math.exp(-0.5), 2 * math.exp(0.1), 0.8]
    assert torch.allclose(loss, torch.tensor([expected]), atol=1e-6)
    assert abs(m["algo/clip_frac"] - 0.5) < 1e-9


def test_ppo_clip_gradient_is_zero_when_clipped_and_ratio_weighted_otherwise():
    logp = torch.tensor([[0.5, 0.05]], requires_grad=True)
    loss, _ = ppo(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), AlgoConfig())
    loss.sum().backward()
    # token 0 clipped above 1.28 with A>0: no gradient; token 1: d(-r*A)/dlogp = -r = -e^{0.05}
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -math.exp(0.05)]]))


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^{2}=7.39 with A=-1: PPO loss 7.39, dual clip c=3 caps at 3.
    loss, _ = _loss([2.0], [0.0], [-1.0])
    assert torch.allclose(loss, torch.tensor([[3.0]]))
    loss, _ = _loss([2.0], [0.0], [-1.0], AlgoConfig(dual_clip=None))
    assert torch.allclose(loss, torch.tensor([[math.exp(2.0)]]))


def test_token_mean_vs_seq_mean_token_mean():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # token_mean: (1+2+3+4)/4 = 2.5; seq_mean_token_mean: (mean(1,2,3)=2 + 4)/2 = 3
    assert LOSS_AGGREGATIONS.get("token_mean")(loss, mask).item() == 2.5
    assert LOSS_AGGREGATIONS.get("seq_mean_token_mean")(loss, mask).item() == 3.0
