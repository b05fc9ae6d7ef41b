"""Each policy loss against hand-computed numbers, and the on-policy reductions between them."""

import math

import pytest
import torch

from tidal.algo import CORRECTIONS, POLICY_LOSSES, bind

t = torch.tensor
E = math.exp


def per_token(name, logp, old, adv, **kw):
    """Each token's loss and its gradient d loss_t / d logp_t, read through one-hot aggregation weights."""
    logp = t([logp], requires_grad=True) if not isinstance(logp, torch.Tensor) else logp
    old, adv = t([old]), t([adv])
    mask = torch.ones_like(old)
    values, grads = [], []
    for j in range(old.shape[1]):
        onehot = torch.zeros_like(old)
        onehot[0, j] = 1.0
        loss, _ = POLICY_LOSSES[name](logp, old, adv, mask, agg_weights_bt=onehot, **kw)
        (g,) = torch.autograd.grad(loss, logp)
        values.append(loss.item())
        grads.append(g[0, j].item())
    return values, grads


def approx(xs, tol=1e-6):
    return pytest.approx(xs, abs=tol, rel=1e-6)


def test_ppo_clip_decoupled_range_hand_computed():
    # ratio e^0.5 = 1.6487, A=+1: clipped at 1.28, no gradient; e^-0.5, A=+1: unclipped, -r;
    # e^0.1, A=-2: inside the range, loss 2r; e^-0.5, A=-1: clipped at 1 - 0.2 -> loss 0.8, no gradient.
    values, grads = per_token("ppo_clip", [0.5, -0.5, 0.1, -0.5], [0.0] * 4, [1.0, 1.0, -2.0, -1.0])
    assert values == approx([-1.28, -E(-0.5), 2 * E(0.1), 0.8])
    assert grads == approx([0.0, -E(-0.5), 2 * E(0.1), 0.0])
    _, m = POLICY_LOSSES["ppo_clip"](
        t([[0.5, -0.5, 0.1, -0.5]]), torch.zeros(1, 4), t([[1.0, 1, -2, -1]]), torch.ones(1, 4)
    )
    assert m["algo/clip_frac"] == 0.5 and m["algo/clip_frac_high"] == 0.25 and m["algo/clip_frac_low"] == 0.25


def test_ppo_clip_token_mean_gradient():
    logp = t([[0.5, 0.05]], requires_grad=True)
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, torch.zeros(1, 2), t([1.0]), torch.ones(1, 2))
    loss.backward()
    # token 0 clipped (ratio 1.65 > 1.28 with A > 0): no gradient; token 1: -r / 2 tokens
    assert logp.grad[0].tolist() == approx([0.0, -E(0.05) / 2])


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 = 7.39 with A = -1: PPO loss 7.39, dual clip c = 3 caps it at 3 (and stops the gradient).
    assert per_token("ppo_clip", [2.0], [0.0], [-1.0]) == (approx([3.0]), approx([0.0]))
    assert per_token("ppo_clip", [2.0], [0.0], [-1.0], dual_clip=None) == (approx([E(2)]), approx([E(2)]))


def test_ppo_clip_extreme_ratios_stay_finite():
    # log-ratio +-20: A=+1 -> clipped 1.28 / unclipped -e^-20; A=-1 -> dual clip 3 / clipped 0.8
    values, grads = per_token("ppo_clip", [20.0, -20.0, 20.0, -20.0], [0.0] * 4, [1.0, 1.0, -1.0, -1.0])
    assert values == approx([-1.28, -E(-20), 3.0, 0.8])
    assert grads == approx([0.0, -E(-20), 0.0, 0.0])


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # ratios e^0.5 (inside), e^2 = 7.39 (clipped to 1 + 4 = 5), e^-20 (no lower bound); loss = -w A logp
    logp = [-0.5, -1.0, -21.0]
    old = [-1.0, -3.0, -1.0]
    adv = [2.0, 1.0, -1.0]
    values, grads = per_token("cispo", logp, old, adv)
    w = [E(0.5), 5.0, E(-20)]
    assert values == approx([-w[i] * adv[i] * logp[i] for i in range(3)])
    assert grads == approx([-w[i] * adv[i] for i in range(3)])
    # PPO would drop the clipped token entirely; CISPO keeps its gradient
    assert per_token("ppo_clip", [-1.0], [-3.0], [1.0])[1] == approx([0.0])


def test_cispo_custom_bounds():
    values, grads = per_token("cispo", [0.0, 0.0], [1.0, -1.0], [1.0, 1.0], eps_low_is=0.2, eps_high_is=0.28)
    # ratios e^-1 = 0.37 -> 0.8, e^1 = 2.72 -> 1.28
    assert grads == approx([-0.8, -1.28]) and values == approx([0.0, 0.0])


def gspo_sequence_form(logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO as the paper writes it (eq. 5-7), one ratio per sequence, mean over sequences."""
    losses = []
    for i in range(logp.shape[0]):
        n = mask[i].sum()
        s = torch.exp(((logp[i] - old[i]) * mask[i]).sum() / n)
        losses.append(-torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return torch.stack(losses).mean()


# delta 0.2: s > 1 + eps clips the A > 0 rows (3 + 4 of 9 tokens); -0.2: s < 1 - eps clips the A < 0 row (2).
@pytest.mark.parametrize(("delta", "clip_frac"), [(1e-4, 0.0), (0.2, 7 / 9), (-0.2, 2 / 9)])
def test_gspo_equals_the_sequence_level_objective_value_and_gradient(delta, clip_frac):
    torch.manual_seed(0)
    old = -torch.rand(3, 4) * 3
    logp = (old + delta + 1e-5 * torch.randn(3, 4)).requires_grad_(True)
    mask = t([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = t([1.0, -0.5, 2.0])
    loss, m = POLICY_LOSSES["gspo"](logp, old, adv, mask)
    (g,) = torch.autograd.grad(loss, logp)
    ref = gspo_sequence_form(logp, old, adv, mask)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(g, g_ref, atol=1e-6)
    assert m["algo/clip_frac"] == pytest.approx(clip_frac)


def test_gspo_hand_computed():
    # mean log-ratio 0.2 -> s = e^0.2 = 1.2214 > 1 + 4e-4, A = 1: clipped, loss -1.0004, no gradient.
    logp = t([[0.1, 0.3]], requires_grad=True)
    loss, _ = POLICY_LOSSES["gspo"](logp, torch.zeros(1, 2), t([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.0004)
    assert torch.autograd.grad(loss, logp)[0].tolist() == [[0.0, 0.0]]
    # mean log-ratio 0 -> s = 1, A = -2: loss 2, each token's gradient s * (-A) / |y| = 1
    logp = t([[0.1, -0.1]], requires_grad=True)
    loss, _ = POLICY_LOSSES["gspo"](logp, torch.zeros(1, 2), t([-2.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(2.0)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == approx([1.0, 1.0])


def test_decoupled_ppo_weights_by_behaviour_ratio_and_clips_against_proximal():
    # behaviour weight pi_prox / pi_behav = e^{ln 2} = 2; ratio to prox e^0.1 inside [0.8, 1.2] (AReaL 0.2)
    logp, prox, behav = t([[0.1, 0.5]], requires_grad=True), t([[0.0, 0.0]]), t([[-math.log(2), 0.0]])
    onehot = [t([[1.0, 0.0]]), t([[0.0, 1.0]])]
    fn = POLICY_LOSSES["decoupled_ppo"]
    l0, _ = fn(logp, behav, t([1.0]), torch.ones(1, 2), prox_logp_bt=prox, agg_weights_bt=onehot[0])
    assert l0.item() == pytest.approx(-2 * E(0.1))
    assert torch.autograd.grad(l0, logp)[0][0].tolist() == approx([-2 * E(0.1), 0.0])
    # token 1: weight 1, ratio e^0.5 clipped at 1.2 (symmetric AReaL range)
    l1, _ = fn(logp, behav, t([1.0]), torch.ones(1, 2), prox_logp_bt=prox, agg_weights_bt=onehot[1])
    assert l1.item() == pytest.approx(-1.2)


def test_decoupled_ppo_behaviour_weight_cap_masks_or_truncates():
    logp, prox, behav = t([[0.0]], requires_grad=True), t([[0.0]]), t([[-2.0]])  # weight e^2 = 7.39 > 5
    kw = dict(prox_logp_bt=prox)
    loss, m = POLICY_LOSSES["decoupled_ppo"](logp, behav, t([1.0]), torch.ones(1, 1), **kw)
    assert loss.item() == 0.0 and m["algo/behav_cap_frac"] == 1.0
    loss, _ = POLICY_LOSSES["decoupled_ppo"](logp, behav, t([1.0]), torch.ones(1, 1), behav_cap_mode="truncate", **kw)
    assert loss.item() == pytest.approx(-5.0)
    loss, _ = POLICY_LOSSES["decoupled_ppo"](logp, behav, t([1.0]), torch.ones(1, 1), behav_weight_cap=None, **kw)
    assert loss.item() == pytest.approx(-E(2))


def test_reinforce_is_advantage_weighted_log_likelihood():
    logp = t([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES["reinforce"](logp, torch.zeros(1, 3), t([[2.0, -1.0, 0.5]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-(2 * -1 + -1 * -2 + 0.5 * -3) / 3)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == approx([-2 / 3, 1 / 3, -0.5 / 3])


# --- off-policy machinery with everything on-policy reduces exactly to the on-policy loss ---


def _batch(seed=0):
    torch.manual_seed(seed)
    logp = (-torch.rand(4, 6) * 2).requires_grad_(True)
    mask = (torch.rand(4, 6) > 0.25).float()
    return logp, mask, torch.randn(4)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_ppo_clip_on_fresh_samples_has_the_reinforce_gradient(agg):
    logp, mask, adv = _batch()
    ppo, _ = POLICY_LOSSES["ppo_clip"](logp, logp.detach(), adv, mask, agg=agg)
    rf, _ = POLICY_LOSSES["reinforce"](logp, logp.detach(), adv, mask, agg=agg)
    g_ppo, g_rf = torch.autograd.grad(ppo, logp)[0], torch.autograd.grad(rf, logp)[0]
    assert torch.allclose(g_ppo, g_rf, atol=1e-7)


@pytest.mark.parametrize("name", ["cispo", "decoupled_ppo"])
def test_importance_corrected_losses_on_fresh_samples_have_the_reinforce_gradient(name):
    logp, mask, adv = _batch(1)
    loss, _ = bind(POLICY_LOSSES[name], prox_logp_bt=logp.detach())(logp, logp.detach(), adv, mask)
    rf, _ = POLICY_LOSSES["reinforce"](logp, logp.detach(), adv, mask)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(rf, logp)[0], atol=1e-7)


def test_decoupled_ppo_with_proximal_equal_to_behaviour_is_ppo_clip():
    logp, mask, adv = _batch(2)
    behav = logp.detach() + 0.3 * torch.randn(4, 6)
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    dec, m_dec = POLICY_LOSSES["decoupled_ppo"](logp, behav, adv, mask, prox_logp_bt=behav, **kw)
    ppo, m_ppo = POLICY_LOSSES["ppo_clip"](logp, behav, adv, mask, **kw)
    assert dec.item() == ppo.item()
    assert torch.equal(torch.autograd.grad(dec, logp)[0], torch.autograd.grad(ppo, logp)[0])
    assert m_dec["algo/clip_frac"] == m_ppo["algo/clip_frac"] > 0


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_corrections_with_equal_logps_are_a_no_op(name, correction):
    logp, mask, adv = _batch(3)
    old = logp.detach() + 0.1 * torch.randn(4, 6)
    weight, _ = CORRECTIONS[correction](old, old.clone(), mask)
    torch.manual_seed(0)  # the same draw for clip_cov's random token selection
    plain, _ = POLICY_LOSSES[name](logp, old, adv, mask)
    torch.manual_seed(0)
    corrected, _ = POLICY_LOSSES[name](logp, old, adv, mask, is_weight_bt=weight)
    assert corrected.item() == plain.item()
    assert torch.equal(torch.autograd.grad(corrected, logp)[0], torch.autograd.grad(plain, logp)[0])


def _scope(name):
    return getattr(POLICY_LOSSES[name], "weight_scope", "token")


def _weighted_and_plain(name):
    """One token's loss (row 1, column 2, through one-hot aggregation weights) with and without weights."""
    logp, mask, adv = _batch(4)
    old = logp.detach() + 0.05 * torch.randn(4, 6)
    weight = torch.rand(4, 6) + 0.5
    onehot = torch.zeros(4, 6)
    onehot[1, 2] = 1.0
    mask[1, 2] = 1.0
    torch.manual_seed(0)  # the same draw for clip_cov's random token selection
    plain, _ = POLICY_LOSSES[name](logp, old, adv, mask, agg_weights_bt=onehot)
    torch.manual_seed(0)
    weighted, _ = POLICY_LOSSES[name](logp, old, adv, mask, agg_weights_bt=onehot, is_weight_bt=weight)
    return weighted, plain, weight, mask


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if _scope(n) == "token"])
def test_is_weight_multiplies_each_tokens_term(name):
    weighted, plain, weight, _ = _weighted_and_plain(name)
    assert weighted.item() == pytest.approx(weight[1, 2].item() * plain.item(), rel=1e-6)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if _scope(n) == "sequence"])
def test_sequence_level_losses_take_the_geometric_mean_weight_of_the_sequence(name):
    weighted, plain, weight, mask = _weighted_and_plain(name)
    keep = mask[1] > 0
    geo_mean = math.exp(weight[1][keep].double().log().mean().item())
    assert weighted.item() == pytest.approx(geo_mean * plain.item(), rel=1e-6)


# --- issue 17: GSPO with token-level importance weights ---


def test_gspo_reduces_token_weights_to_their_geometric_mean_per_sequence():
    # The input: logp = old = -1 on 3 tokens, A = 1, token weights (2, 1, 0.5), clip 3e-4 / 4e-4.
    # s = exp(mean_t(logp - old)) = 1 lies inside [1 - 3e-4, 1 + 4e-4] (no clip) and ds/dlogp_t = s / 3.
    # One weight per sequence, the geometric mean w = (2 * 1 * 0.5)^(1/3) = 1:
    #   loss = -w s A = -1,   d loss / d logp_t = -w A s / 3 = -1/3 for every token.
    # Not what tidal computes, for comparison:
    # - slime and AReaL weight each token's copy of the shared, differentiable s by w_t, which is the
    #   arithmetic mean 7/6: loss -7/6 = -1.16667 and gradient -7/18 = -0.38889 per token (the numbers);
    # - verl (and tidal before issue 17) weight GSPO-token's per-token terms: loss -7/6, gradient
    #   -w_t / 3 = (-0.667, -0.333, -0.167), GSPO-token's gradient reweighted per token.
    logp = t([[-1.0, -1.0, -1.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES["gspo"](logp, t([[-1.0, -1.0, -1.0]]), t([1.0]), torch.ones(1, 3),
                                    is_weight_bt=t([[2.0, 1.0, 0.5]]))
    assert loss.item() == pytest.approx(-1.0)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == approx([-1 / 3] * 3)
    # weights (4, 1, 2): geometric mean 8^(1/3) = 2 -> loss -2, gradient -2/3 per token; the masked 4th
    # token's weight (100) takes no part and its gradient is 0.
    logp = t([[-1.0, -1.0, -1.0, -3.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES["gspo"](logp, -torch.ones(1, 4), t([1.0]), t([[1.0, 1.0, 1.0, 0.0]]),
                                    is_weight_bt=t([[4.0, 1.0, 2.0, 100.0]]))
    assert loss.item() == pytest.approx(-2.0)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == approx([-2 / 3, -2 / 3, -2 / 3, 0.0])


def test_gspo_with_uncapped_token_weights_is_gspo_against_the_sampling_policy():
    # w_t = pi_old / pi_behav: the geometric mean times s_i is exp(mean_t(logp - behav)), the sequence-level
    # GSPO ratio to the policy that sampled (a clip range of 10 keeps every ratio unclipped).
    torch.manual_seed(5)
    behav = -torch.rand(2, 4) * 2
    old = behav + 0.3 * torch.randn(2, 4)
    logp = (old + 0.2 * torch.randn(2, 4)).requires_grad_(True)
    mask, adv = t([[1.0, 1, 1, 0], [1, 1, 1, 1]]), t([1.0, -2.0])
    kw = dict(eps_low=10.0, eps_high=10.0)
    loss, _ = POLICY_LOSSES["gspo"](logp, old, adv, mask, is_weight_bt=(old - behav).exp(), **kw)
    ref = gspo_sequence_form(logp, behav, adv, mask, **kw)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0], atol=1e-6)


def test_gspo_drops_a_sequence_with_a_zero_token_weight():
    # token-level MIS (IcePop) zeroes one token's weight: the sequence's geometric mean is 0
    logp = t([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES["gspo"](logp, -torch.ones(2, 2), t([1.0, 1.0]), torch.ones(2, 2),
                                    is_weight_bt=t([[1.0, 0.0], [1.0, 1.0]]))
    assert loss.item() == pytest.approx(-0.5)  # only sequence 1: -s A = -1, mean over 2 sequences
    assert torch.autograd.grad(loss, logp)[0].flatten().tolist() == approx([0.0, 0.0, -0.25, -0.25])


# --- GMPO (arXiv 2507.20673) ---


def gmpo_sequence_form(logp, old, adv, mask, eps=0.4):
    """GMPO as its reference code writes it, one sequence at a time: the sign-aware clip of the log-ratios
    in log space, exp of their mean, times -A; then the mean over sequences."""
    losses = []
    for i in range(logp.shape[0]):
        sgn = 1.0 if adv[i] >= 0 else -1.0
        d = (logp[i] - old[i])[mask[i] > 0]
        d_clip = sgn * torch.minimum(sgn * d, sgn * d.clamp(-eps, eps))
        losses.append(-adv[i] * torch.exp(d_clip.mean()))
    return torch.stack(losses).mean()


def test_gmpo_hand_computed():
    # Sequence 0, A = +1, log-ratios (0.1, 0.6, -0.2): for A >= 0 only the upper log bound 0.4 binds:
    #   c = (0.1, 0.4, -0.2), mean 0.1, s_0 = e^0.1, loss_0 = -e^0.1; token 1 is clipped (no gradient).
    # Sequence 1, A = -2, log-ratios (-0.6, 0.5), third token masked: for A < 0 only the lower bound binds:
    #   c = (-0.4, 0.5), mean 0.05, s_1 = e^0.05, loss_1 = 2 e^0.05; token 0 is clipped.
    # Mean over sequences: (-e^0.1 + 2 e^0.05) / 2. Gradient through an unclipped token: -A_i s_i / |y_i| / 2:
    #   row 0: (-e^0.1 / 6, 0, -e^0.1 / 6); row 1: (0, 2 e^0.05 / 4, 0).
    logp = t([[0.1, 0.6, -0.2], [-0.6, 0.5, 9.0]], requires_grad=True)
    mask = t([[1.0, 1, 1], [1, 1, 0]])
    loss, m = POLICY_LOSSES["gmpo"](logp, torch.zeros(2, 3), t([1.0, -2.0]), mask)
    assert loss.item() == pytest.approx((-E(0.1) + 2 * E(0.05)) / 2, rel=1e-6)
    g = torch.autograd.grad(loss, logp)[0]
    assert g[0].tolist() == approx([-E(0.1) / 6, 0.0, -E(0.1) / 6])
    assert g[1].tolist() == approx([0.0, E(0.05) / 2, 0.0])
    assert (m["algo/clip_frac"], m["algo/clip_frac_high"], m["algo/clip_frac_low"]) == approx([2 / 5, 1 / 5, 1 / 5])
    assert m["algo/seq_ratio_mean"] == pytest.approx((E(0.1) + E(0.05)) / 2, rel=1e-6)


@pytest.mark.parametrize("adv_shape", ["b", "bt"])
def test_gmpo_equals_its_reference_sequence_form(adv_shape):
    torch.manual_seed(3)
    old = -torch.rand(3, 5) * 3
    logp = (old + 0.4 * torch.randn(3, 5)).requires_grad_(True)  # log-ratios beyond +-0.4: some tokens clip
    mask = t([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    adv_b = t([1.5, -0.5, -2.0])
    # a [B, T] advantage counts as its mean over the response tokens (here: the same per-sequence value)
    adv = adv_b if adv_shape == "b" else adv_b[:, None] + torch.where(mask > 0, 0.0, 7.0)
    loss, m = POLICY_LOSSES["gmpo"](logp, old, adv, mask)
    ref = gmpo_sequence_form(logp, old, adv_b, mask)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0], atol=1e-6)
    assert 0 < m["algo/clip_frac"] < 1


# --- SAPO (arXiv 2511.20347) ---


def test_sapo_soft_gate_hand_computed():
    # f(r) = (4 / tau) sigmoid(tau (r - 1)), loss_t = -f(r_t) A_t, d loss_t / d logp_t = -4 s (1 - s) r A with
    # s = sigmoid(tau (r - 1)); tau = 1 for A > 0, 1.05 for A <= 0 (SAPO's defaults). Float64 re-derivation:
    def sig(x):
        return 1 / (1 + math.exp(-x))

    ratios, adv = [1.0, 1.5, 0.5, 3.0], [1.0, 1.0, -1.0, -0.5]
    values, grads = per_token("sapo", [math.log(r) for r in ratios], [0.0] * 4, adv)
    taus = [1.0 if a > 0 else 1.05 for a in adv]
    gates = [sig(tau * (r - 1)) for r, tau in zip(ratios, taus)]
    assert values == approx([-(4 / tau) * s * a for s, tau, a in zip(gates, taus, adv)])
    assert grads == approx([-4 * s * (1 - s) * r * a for s, r, a in zip(gates, ratios, adv)])
    # on-policy (r = 1) the gradient is the plain policy gradient -A, the value -2 A / tau
    assert (values[0], grads[0]) == approx([-2.0, -1.0])
    # far off-policy the gate decays instead of cutting off: r = 3 with A < 0 keeps the weight
    # 4 s (1 - s) = 0.39 (s = sigmoid(1.05 * 2)) of its policy gradient -r A, where PPO's clip would give 0
    assert grads[3] == pytest.approx(0.389 * 3 * 0.5, rel=1e-3)


def test_sapo_rejects_a_non_positive_temperature():
    with pytest.raises(ValueError, match="sapo_tau_neg"):
        POLICY_LOSSES["sapo"](torch.zeros(1, 2), torch.zeros(1, 2), t([1.0]), torch.ones(1, 2), sapo_tau_neg=0.0)


@pytest.mark.parametrize("name", ["sapo", "gmpo", "kl_cov"])
def test_new_losses_on_fresh_samples_have_the_reinforce_gradient(name):
    # r = 1: SAPO's gate weight 4 s (1 - s) is 1, GMPO's s_i is 1 with nothing clipped, and KL-Cov's |log r|
    # has zero gradient at 0; each is then the policy gradient -A grad log pi.
    logp, mask, adv = _batch(1)
    loss, _ = POLICY_LOSSES[name](logp, logp.detach(), adv, mask, agg="seq_mean_token_mean")
    rf, _ = POLICY_LOSSES["reinforce"](logp, logp.detach(), adv, mask, agg="seq_mean_token_mean")
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(rf, logp)[0], atol=1e-7)
