"""GAE, the clipped value loss and explained variance against hand-computed numbers (``tidal/algo/value.py``)."""

import pytest
import torch

from tidal.algo import VALUE_ADVANTAGES, AlgoConfig, bind, explained_variance, value_loss
from tidal.algo.value import masked_whiten, token_rewards


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def _close(a, b, atol=1e-6):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), t(b), atol=atol), f"{a} != {b}"


# A 2 x 4 batch. Row 0: response at columns 0-2, padding at 3. Row 1: a prompt token at column 0,
# response at 1-3. The 9.0 values sit where the mask is 0 and must not matter.
MASK = t([[1, 1, 1, 0], [0, 1, 1, 1]])
VALUES = t([[0.5, 0.2, 0.4, 9.0], [9.0, 0.1, -0.3, 0.6]])
REWARDS = t([1.0, -1.0])


def test_token_rewards_put_the_outcome_on_the_last_response_token():
    mask = t([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])  # row 2: an observation gap; row 3: empty
    _close(token_rewards(t([1.0, -1.0, 2.0, 5.0]), mask),
           [[0, 0, 1, 0], [0, 0, 0, -1], [0, 0, 2, 0], [0, 0, 0, 0]])


def test_gae_by_hand_with_gamma_and_lambda_below_one():
    """gamma = 0.9, lam = 0.8 (gamma lam = 0.72), no whitening. delta_t = r_t + 0.9 V_{t+1} - V_t.
    Row 0 (r = 1 at column 2): delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.9 * 0.4 - 0.2 = 0.16;
    delta_0 = 0.9 * 0.2 - 0.5 = -0.32. A_2 = 0.6, A_1 = 0.16 + 0.72 * 0.6 = 0.592,
    A_0 = -0.32 + 0.72 * 0.592 = 0.10624. R = A + V: 1.0, 0.792, 0.60624.
    Row 1 (r = -1 at column 3): delta_3 = -1 - 0.6 = -1.6; delta_2 = 0.9 * 0.6 + 0.3 = 0.84;
    delta_1 = 0.9 * -0.3 - 0.1 = -0.37. A_3 = -1.6, A_2 = 0.84 - 0.72 * 1.6 = -0.312,
    A_1 = -0.37 - 0.72 * 0.312 = -0.59464. R: -0.49464, -0.612, -1.0."""
    adv, ret = VALUE_ADVANTAGES["gae"](REWARDS, VALUES, MASK, gamma=0.9, lam=0.8, gae_whiten=False)
    _close(adv, [[0.10624, 0.592, 0.6, 0.0], [0.0, -0.59464, -0.312, -1.6]])
    _close(ret, [[0.60624, 0.792, 1.0, 0.0], [0.0, -0.49464, -0.612, -1.0]])


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    """verl's defaults: A_t = r - V_t, R_t = r on every response token."""
    adv, ret = VALUE_ADVANTAGES["gae"](REWARDS, VALUES, MASK, gae_whiten=False)
    _close(adv, [[0.5, 0.8, 0.6, 0.0], [0.0, -1.1, -0.7, -1.6]])
    assert torch.equal(ret, t([[1.0, 1.0, 1.0, 0.0], [0.0, -1.0, -1.0, -1.0]]))  # exactly, no value rounding


def test_gae_lambda_zero_is_the_one_step_td_error():
    adv, _ = VALUE_ADVANTAGES["gae"](REWARDS, VALUES, MASK, gamma=0.9, lam=0.0, gae_whiten=False)
    _close(adv, [[-0.32, 0.16, 0.6, 0.0], [0.0, -0.37, 0.84, -1.6]])


def test_gae_skips_observation_tokens():
    """An agent episode [sampled, observation, sampled]: the observation's value (7.0) is never used and
    the first token's next state is the third token's, as if the observation were not there.
    A_2 = 1 - 0.4 = 0.6; A_0 = (0.9 * 0.4 - 0.5) + 0.72 * 0.6 = 0.292."""
    adv, ret = VALUE_ADVANTAGES["gae"](t([1.0]), t([[0.5, 7.0, 0.4]]), t([[1, 0, 1]]), gamma=0.9, lam=0.8,
                                       gae_whiten=False)
    _close(adv, [[0.292, 0.0, 0.6]])
    _close(ret, [[0.792, 0.0, 1.0]])
    gapless, _ = VALUE_ADVANTAGES["gae"](t([1.0]), t([[0.5, 0.4]]), t([[1, 1]]), gamma=0.9, lam=0.8, gae_whiten=False)
    _close(adv[:, [0, 2]], gapless.tolist())


def test_gae_whitening_is_over_the_batch_response_tokens():
    """The six response-token advantages of the gamma = 0.9, lam = 0.8 example, whitened with their mean
    and unbiased std; masked positions stay 0 and the returns are not whitened."""
    raw = [0.10624, 0.592, 0.6, -0.59464, -0.312, -1.6]
    mean = sum(raw) / 6
    std = (sum((a - mean) ** 2 for a in raw) / 5) ** 0.5
    w = [(a - mean) / (std + 1e-6) for a in raw]
    adv, ret = VALUE_ADVANTAGES["gae"](REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    _close(adv, [[w[0], w[1], w[2], 0.0], [0.0, w[3], w[4], w[5]]])
    _close(ret, [[0.60624, 0.792, 1.0, 0.0], [0.0, -0.49464, -0.612, -1.0]])


def test_masked_whiten_by_hand_and_degenerate_cases():
    # 1, 2, 3 under the mask: mean 2, unbiased std 1
    _close(masked_whiten(t([[1.0, 2.0, 50.0], [3.0, -8.0, 0.0]]), t([[1, 1, 0], [1, 0, 0]])),
           [[-1 / (1 + 1e-6), 0.0, 0.0], [1 / (1 + 1e-6), 0.0, 0.0]])
    _close(masked_whiten(t([[4.0, 4.0]]), t([[1, 1]])), [[0.0, 0.0]])  # no spread: 0, not NaN
    _close(masked_whiten(t([[4.0, 1.0]]), t([[1, 0]])), [[0.0, 0.0]])  # one token: no std


def test_gae_runs_from_a_config_and_has_no_gradient():
    values = VALUES.clone().requires_grad_(True)
    adv, ret = bind(VALUE_ADVANTAGES["gae"], AlgoConfig(advantage="gae", gamma=0.9, lam=0.8))(REWARDS, values, MASK)
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.isfinite(adv).all() and adv[MASK == 0].abs().sum() == 0


# Value loss: 2 x 3, four response tokens, value_clip = 0.2.
#   token (0,0): V 0.5, V_old 0.4, R 1.0: moved 0.1, inside the clip: both errors 0.25
#   token (0,1): V 0.9, V_old 0.4, R 1.0: moved 0.5, V_clip = 0.6: errors 0.01 and 0.16, the max is clipped
#   token (0,2): V 0.0, V_old 0.4, R 1.0: moved -0.4, V_clip = 0.2: errors 1.0 and 0.64, the max unclipped
#   token (1,1): V 0.1, V_old 0.0, R -1.0: inside the clip: 1.21
# (1,0) and (1,2) are masked.
V = [[0.5, 0.9, 0.0], [-0.5, 0.1, 3.0]]
V_OLD = t([[0.4, 0.4, 0.4], [0.0, 0.0, 0.0]])
RET = t([[1.0, 1.0, 1.0], [-1.0, -1.0, 5.0]])
VMASK = t([[1, 1, 1], [0, 1, 0]])


def test_clipped_value_loss_value_and_gradient_by_hand():
    """loss = vf_coef * 1/2 * mean over 4 tokens of the max error = 2 * 0.5 * (0.25 + 0.16 + 1.0 + 1.21) / 4.
    d/dV = vf_coef * 1/2 * 1/4 * 2 (V - R) where the unclipped error is the max, 0 where the clipped one
    is (the clamp is flat there): -0.25, 0, -0.5, 0.55; masked tokens 0."""
    v = t(V).requires_grad_(True)
    loss, metrics = value_loss(v, V_OLD, RET, VMASK, value_clip=0.2, vf_coef=2.0)
    assert loss.item() == pytest.approx(2 * 0.5 * 2.62 / 4, abs=1e-6)
    assert metrics["critic/value_loss"] == pytest.approx(0.5 * 2.62 / 4, abs=1e-6)  # before vf_coef
    assert metrics["critic/clip_frac"] == pytest.approx(0.25)
    assert metrics["critic/values_mean"] == pytest.approx((0.5 + 0.9 + 0.0 + 0.1) / 4)
    (grad,) = torch.autograd.grad(loss, v)
    _close(grad, [[-0.25, 0.0, -0.5], [0.0, 0.55, 0.0]])


def test_unclipped_value_loss_is_half_the_squared_error():
    """value_clip None: 1/2 mean (V - R)^2 = 0.5 * (0.25 + 0.01 + 1.0 + 1.21) / 4; gradient (V - R) / 4."""
    v = t(V).requires_grad_(True)
    loss, metrics = value_loss(v, V_OLD, RET, VMASK, value_clip=None)
    assert loss.item() == pytest.approx(0.5 * 2.47 / 4, abs=1e-6)
    assert metrics["critic/clip_frac"] == 0.0
    (grad,) = torch.autograd.grad(loss, v)
    _close(grad, [[-0.125, -0.025, -0.25], [0.0, 0.275, 0.0]])


def test_value_loss_splits_over_micro_batches_with_full_batch_weights():
    from tidal.algo import aggregation_weights

    w = aggregation_weights(VMASK, agg="seq_mean_token_mean")
    full, _ = value_loss(t(V), V_OLD, RET, VMASK, agg="seq_mean_token_mean")
    parts = [value_loss(t(V)[r], V_OLD[r], RET[r], VMASK[r], agg_weights_bt=w[r])[0] for r in ([0], [1])]
    assert torch.isclose(sum(parts), full)


def test_value_loss_knobs_come_from_the_config():
    cfg = AlgoConfig(advantage="gae", value_clip=0.2, vf_coef=2.0)
    assert cfg.kwargs_for(value_loss) == {"value_clip": 0.2, "vf_coef": 2.0, "max_gen_len": None}
    assert AlgoConfig().kwargs_for(VALUE_ADVANTAGES["gae"]) == {"gamma": 1.0, "lam": 1.0, "gae_whiten": True,
                                                               "adv_eps": 1e-6}


def test_explained_variance_by_hand():
    """R = 1, 2, 3, 4 and V = 1, 2, 2, 5 on the mask: R - V = 0, 0, 1, -1, population variance 0.5;
    Var(R) = 1.25; 1 - 0.5 / 1.25 = 0.6. The padded entries (100) are ignored."""
    mask = t([[1, 1, 0], [1, 1, 0]])
    ev = explained_variance(t([[1.0, 2.0, 100.0], [2.0, 5.0, 100.0]]), t([[1.0, 2.0, -100.0], [3.0, 4.0, 0.0]]), mask)
    assert ev == pytest.approx(0.6)
    assert explained_variance(t([[0.0, 1.0]]), t([[1.0, 1.0]]), t([[1, 1]])) == 0.0  # constant returns
    assert explained_variance(t([[0.0, 1.0]]), t([[0.0, 1e-6]]), t([[1, 1]])) == 0.0  # rounding noise, not -1e12
    assert explained_variance(t([[1.0, 2.0]]), t([[1.0, 2.0]]), t([[1, 1]])) == pytest.approx(1.0)
