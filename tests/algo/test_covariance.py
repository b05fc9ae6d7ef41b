"""Clip-Cov and KL-Cov (arXiv 2505.22617) against hand-computed covariances, values and gradients."""

import math

import pytest
import torch

from tidal.algo import POLICY_LOSSES
from tidal.algo.covariance import token_covariance

t = torch.tensor
E = math.exp

# One sequence of 5 tokens (plus a masked 6th): logp mean -3 -> centered (2, 1, 0, -1, -2);
# advantages (3, 3, 0, -2, -4) have mean 0 -> Cov_t = (6, 3, 0, 2, 8), and 0 on the masked token.
LOGP = [-1.0, -2.0, -3.0, -4.0, -5.0, 7.0]
ADV = [3.0, 3.0, 0.0, -2.0, -4.0, 50.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def _inputs(log_ratio):
    logp = t([LOGP], requires_grad=True)
    old = logp.detach() - t([log_ratio + [0.0]])
    return logp, old, t([ADV]), t([MASK])


def approx(xs):
    return pytest.approx(xs, abs=1e-6, rel=1e-6)


def test_token_covariance_hand_computed():
    _, _, adv, mask = _inputs([0.0] * 5)
    assert token_covariance(t([LOGP]), adv, mask)[0].tolist() == approx([6.0, 3.0, 0.0, 2.0, 8.0, 0.0])


def test_clip_cov_detaches_a_band_token_not_clipped_by_ppo():
    # log-ratios (0, 0.1, 0, -0.5, 0), PPO range 0.2 / 0.28. The band (1, 5) holds tokens 1 (Cov 3) and 3
    # (Cov 2); token 3 (A = -2, r = e^-0.5 < 0.8) is already clipped by PPO, so token 1 is the candidate;
    # max(1, floor(2e-4 * 5)) = 1 token is detached: token 1, deterministically. Tokens 0 (Cov 6) and 4 (8)
    # lie above the band. Per-token losses -min(r A, clip(r) A):
    #   (-3, 0 [detached; -3 e^0.1 otherwise], 0 [A = 0], -(-2)(0.8) = 1.6 [clipped], 4);  token mean 2.6 / 5
    # gradients -r A / 5 where neither clipped nor detached: (-3/5, 0, 0, 0, 4/5), 0 on the masked token.
    logp, old, adv, mask = _inputs([0.0, 0.1, 0.0, -0.5, 0.0])
    loss, m = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(2.6 / 5)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == approx([-0.6, 0.0, 0.0, 0.0, 0.8, 0.0])
    assert m["algo/cov_clip_frac"] == pytest.approx(0.2) and m["algo/clip_frac"] == pytest.approx(0.2)
    # an empty band (nothing between 10 and 20) leaves PPO's surrogate: token 1 back to -3 e^0.1
    loss, m = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_cov_low=10.0,
                                        clip_cov_high=20.0)
    ppo, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=None)
    assert loss.item() == pytest.approx((2.6 - 3 * E(0.1)) / 5) and loss.item() == pytest.approx(ppo.item())
    assert m["algo/cov_clip_frac"] == 0.0


def test_clip_cov_draws_its_tokens_at_random_from_the_band():
    # 40 fresh tokens, logp -1 (20) and -3 (20): centered +-1. Advantages (2, 0.5, -2, -0.5) x 10 have mean
    # 0, so Cov = 2 on tokens 0-9 and 20-29 (in the band (1, 5)) and 0.5 elsewhere. clip_cov_frac = 0.05:
    # max(1, floor(0.05 * 40)) = 2 tokens, drawn from those 20, lose their gradient (-A / 40 otherwise).
    logp = t([[-1.0] * 20 + [-3.0] * 20], requires_grad=True)
    adv = t([[2.0] * 10 + [0.5] * 10 + [-2.0] * 10 + [-0.5] * 10])
    band = set(range(10)) | set(range(20, 30))
    draws = set()
    for seed in range(8):
        torch.manual_seed(seed)
        loss, m = POLICY_LOSSES["clip_cov"](logp, logp.detach(), adv, torch.ones(1, 40), clip_cov_frac=0.05)
        grad = torch.autograd.grad(loss, logp)[0][0]
        detached = {i for i in range(40) if grad[i] == 0}
        assert len(detached) == 2 and detached <= band and m["algo/cov_clip_frac"] == pytest.approx(2 / 40)
        assert torch.allclose(grad[[i for i in range(40) if i not in detached]],
                              -adv[0, [i for i in range(40) if i not in detached]] / 40)
        draws.add(frozenset(detached))
    assert len(draws) > 1, "the draw should vary with the RNG"


def test_kl_cov_penalizes_the_top_covariance_tokens():
    # log-ratios (0, 0.1, 0, -0.5, 0.3); k = 0.2 -> max(1, floor(0.2 * 5)) = 1 token, the largest Cov: token 4.
    # loss_t = -r A (+ beta |log r| on token 4): (-3, -3 e^0.1, 0, 2 e^-0.5, 4 e^0.3 + 0.3 beta), token mean;
    # gradients -r A (+ beta sign(log r)): (-3, -3 e^0.1, 0, 2 e^-0.5, 4 e^0.3 + beta) / 5.
    logp, old, adv, mask = _inputs([0.0, 0.1, 0.0, -0.5, 0.3])
    for beta in (1.0, 0.5):
        loss, m = POLICY_LOSSES["kl_cov"](logp, old, adv, mask, kl_cov_frac=0.2, kl_cov_coef=beta)
        want = (-3 - 3 * E(0.1) + 2 * E(-0.5) + 4 * E(0.3) + 0.3 * beta) / 5
        assert loss.item() == approx(want)  # float32 log-ratios: ~1e-7 off
        grad = torch.autograd.grad(loss, logp)[0][0].tolist()
        assert grad == approx([-3 / 5, -3 * E(0.1) / 5, 0.0, 2 * E(-0.5) / 5, (4 * E(0.3) + beta) / 5, 0.0])
        assert m["algo/kl_cov_frac"] == pytest.approx(0.2)


@pytest.mark.parametrize(("name", "knob", "value"), [
    ("clip_cov", "clip_cov_frac", 0.0),
    ("clip_cov", "clip_cov_high", 0.5),  # below clip_cov_low = 1
    ("kl_cov", "kl_cov_frac", 1.5),
    ("kl_cov", "kl_cov_coef", -1.0),
])
def test_bad_knobs_name_the_key(name, knob, value):
    logp, old, adv, mask = _inputs([0.0] * 5)
    with pytest.raises(ValueError, match=knob):
        POLICY_LOSSES[name](logp, old, adv, mask, **{knob: value})
