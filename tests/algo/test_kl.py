import math

import pytest
import torch

from tidal.algo import KL_ESTIMATORS, kl_loss, kl_reward_penalty

t = torch.tensor


def test_estimators_hand_computed():
    # d = log(pi / pi_ref) = ln 2: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = r - 1 - log r with r = 1/2
    d = math.log(2)
    logp, ref = t([[d, 0.0, -20.0]]), t([[0.0, 0.0, 0.0]])
    assert KL_ESTIMATORS["k1"](logp, ref)[0].tolist() == pytest.approx([d, 0.0, -20.0])
    assert KL_ESTIMATORS["k2"](logp, ref)[0].tolist() == pytest.approx([d * d / 2, 0.0, 200.0])
    k3 = KL_ESTIMATORS["k3"](logp, ref)[0]
    assert k3.tolist() == pytest.approx([0.5 - 1 + d, 0.0, math.exp(20) - 1 - 20], rel=1e-6)


def test_k1_and_k3_are_unbiased_exactly():
    """E_{x~p}[k(x)] over a categorical, summed exactly, equals KL(p || q) for k1 and k3; k2 >= 0."""
    p = t([0.5, 0.3, 0.15, 0.05])
    q = t([0.25, 0.25, 0.25, 0.25])
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    logp, logq = p.log().unsqueeze(0), q.log().unsqueeze(0)
    for name in ("k1", "k3"):
        assert (p * KL_ESTIMATORS[name](logp, logq)[0]).sum().item() == pytest.approx(kl, rel=1e-5)
    assert (KL_ESTIMATORS["k2"](logp, logq) >= 0).all() and (KL_ESTIMATORS["k3"](logp, logq) >= 0).all()


def test_kl_loss_is_coef_times_aggregated_estimate_with_grad_only_on_response_tokens():
    logp = t([[0.5, -0.5, 3.0]], requires_grad=True)
    ref, mask = torch.zeros(1, 3), t([[1.0, 1.0, 0.0]])
    loss, m = kl_loss(logp, ref, mask, kl_coef=0.1, kl_estimator="k2")
    assert loss.item() == pytest.approx(0.1 * (0.125 + 0.125) / 2)
    assert m["algo/kl"] == pytest.approx(0.125)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0].tolist() == pytest.approx([0.1 * 0.5 / 2, -0.1 * 0.5 / 2, 0.0])


def test_kl_loss_defaults_are_grpos():
    logp, ref, mask = t([[math.log(2)]]), torch.zeros(1, 1), torch.ones(1, 1)
    loss, _ = kl_loss(logp, ref, mask)
    assert loss.item() == pytest.approx(0.04 * (0.5 - 1 + math.log(2)))


def test_reward_penalty_sums_each_sequence():
    logp = t([[1.0, 2.0, 5.0], [0.5, 0.0, 0.0]])
    pen = kl_reward_penalty(logp, torch.zeros(2, 3), t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), kl_coef=0.5)
    assert pen.tolist() == pytest.approx([0.5 * 3.0, 0.5 * 0.5])
    assert not pen.requires_grad
