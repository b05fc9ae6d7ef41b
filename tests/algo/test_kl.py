import math

import pytest
import torch

from tidal.algo import KL_ESTIMATORS, kl_loss, kl_reward_penalty, kl_reward_penalty_tokens

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


# ---- DeepSeek-V3.2's importance-weighted k3 ---------------------------------------------------------------


def test_k3_is_hand_computed():
    # pi = 0.4, pi_old = 0.5, pi_ref = 0.2: w = 0.8, r = pi_ref / pi = 0.5, k3 = 0.5 - 1 + ln 2
    logp, old, ref = t([[math.log(0.4)]]), t([[math.log(0.5)]]), t([[math.log(0.2)]])
    k3 = 0.5 - 1 + math.log(2)
    assert KL_ESTIMATORS["k3_is"](logp, ref, old_logp_bt=old).item() == pytest.approx(0.8 * k3, rel=1e-6)
    # without old log-probs the weight is pi / sg(pi) = 1 in value ...
    logp = logp.clone().requires_grad_(True)
    value = KL_ESTIMATORS["k3_is"](logp, ref)
    assert value.item() == pytest.approx(k3, rel=1e-6)
    # ... and d/dlogp (w k3) = k3 + dk3/dlogp = (r - 1 - log r) + (1 - r) = -log r = ln 2: k1's score-function term
    (g,) = torch.autograd.grad(value.sum(), logp)
    assert g.item() == pytest.approx(math.log(2), rel=1e-6)


def test_k3_is_value_and_gradient_are_unbiased_under_the_sampling_policy():
    """Over a categorical, summed exactly under the sampler pi_old: E_old[(pi / pi_old) k3] = KL(pi || pi_ref)
    and its gradient is grad KL(pi || pi_ref). Plain k3 under sg(pi) has the right value but the gradient of
    KL(pi_ref || pi): the bias the importance weight's gradient removes."""
    theta = t([0.3, -0.2, 1.0, 0.1], requires_grad=True)
    logq = t([0.25, 0.25, 0.25, 0.25]).log()
    logo = t([0.1, 0.2, 0.3, 0.4]).log()  # the sampler (engine), not pi

    def kl_pq(th):
        logp = th.log_softmax(-1)
        return (logp.exp() * (logp - logq)).sum()

    (want,) = torch.autograd.grad(kl_pq(theta), theta)
    logp = theta.log_softmax(-1)
    est = (logo.exp() * KL_ESTIMATORS["k3_is"](logp[None], logq[None], old_logp_bt=logo[None])[0]).sum()
    (got,) = torch.autograd.grad(est, theta)
    assert est.item() == pytest.approx(kl_pq(theta).item(), rel=1e-5)
    assert torch.allclose(got, want, atol=1e-6)

    logp = theta.log_softmax(-1)
    plain = (logp.exp().detach() * KL_ESTIMATORS["k3"](logp[None], logq[None])[0]).sum()
    (biased,) = torch.autograd.grad(plain, theta)
    (reverse,) = torch.autograd.grad((logq.exp() * (logq - theta.log_softmax(-1))).sum(), theta)
    assert plain.item() == pytest.approx(kl_pq(theta).item(), rel=1e-5)
    assert torch.allclose(biased, reverse, atol=1e-6) and not torch.allclose(biased, want, atol=1e-3)


def test_kl_loss_hands_the_behaviour_logprobs_to_estimators_that_take_them():
    logp, ref, mask = t([[math.log(0.4), 0.0]]), t([[math.log(0.2), 0.0]]), t([[1.0, 0.0]])
    behav = t([[math.log(0.5), 0.0]])
    loss, m = kl_loss(logp, ref, mask, kl_coef=1.0, kl_estimator="k3_is", behav_logp_bt=behav)
    assert loss.item() == pytest.approx(0.8 * (0.5 - 1 + math.log(2)), rel=1e-6)
    loss, _ = kl_loss(logp, ref, mask, kl_coef=1.0, kl_estimator="k1", behav_logp_bt=behav)  # k1 ignores it
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)


def test_reward_penalty_per_token_sums_to_the_sequence_penalty():
    logp = t([[1.0, 2.0, 5.0], [0.5, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tokens = kl_reward_penalty_tokens(logp, torch.zeros(2, 3), mask, kl_coef=0.5)
    assert tokens.tolist() == [[0.5, 1.0, 0.0], [0.25, 0.0, 0.0]]
    assert torch.equal(tokens.sum(-1), kl_reward_penalty(logp, torch.zeros(2, 3), mask, kl_coef=0.5))
