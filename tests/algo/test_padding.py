"""Masked positions may hold anything: +-inf or NaN padding changes no loss, gradient, weight or metric.

Log-probs are legally -inf at padding (a token the sampler's top-k/top-p removed, a row padded with
-inf by an engine), and a difference of two -inf paddings is NaN. Every function in ``tidal.algo`` that
takes a mask must then give exactly what it gives with finite padding: a ``(x - y) * mask`` turns the
padding into NaN (0 * inf), which poisons a sum's value and, through the chain rule, the gradient of
the whole row. Each case below runs twice, once with finite padding and once with non-finite padding,
and asserts the two agree (and are finite).
"""

import math

import pytest
import torch

from tidal.algo import (
    ADVANTAGES,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    advantage_metrics,
    distill_advantage,
    entropy_loss,
    high_entropy_mask,
    kl_loss,
    kl_reward_penalty,
    kl_reward_penalty_tokens,
    masked_mean,
    sequence_log_ratio,
    value_loss,
)
from tidal.algo.covariance import token_covariance
from tidal.algo.value import explained_variance, gae

B, T = 4, 5
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
PAD = MASK == 0
INF, NAN = math.inf, math.nan
# the padding each input gets: every tensor the same, or log-probs -inf against +inf (their difference is -inf)
PADDINGS = {
    "-inf": dict.fromkeys(("logp", "old", "prox", "ref", "adv", "w", "x"), -INF),
    "+inf": dict.fromkeys(("logp", "old", "prox", "ref", "adv", "w", "x"), INF),
    "nan": dict.fromkeys(("logp", "old", "prox", "ref", "adv", "w", "x"), NAN),
    "mixed": {"logp": -INF, "old": INF, "prox": NAN, "ref": -INF, "adv": NAN, "w": INF, "x": -INF},
}


def _padded(x: torch.Tensor, value: float, grad: bool = False) -> torch.Tensor:
    out = torch.where(PAD, torch.full_like(x, value), x).detach()
    return out.requires_grad_(grad)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    return {
        "logp": logp,
        "old": logp + 0.3 * torch.randn(B, T, generator=g),
        "prox": logp + 0.2 * torch.randn(B, T, generator=g),
        "ref": logp + 0.5 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, T, generator=g),
        "w": torch.rand(B, T, generator=g) + 0.5,
        "x": torch.randn(B, T, generator=g),
    }


def _both(seed: int, padding: str, grad: tuple[str, ...] = ()):
    """The same inputs twice: padded with finite values (the inputs' own), and with ``padding``."""
    clean = _inputs(seed)
    finite = {k: _padded(v, 0.7, k in grad) for k, v in clean.items()}
    bad = {k: _padded(v, PADDINGS[padding][k], k in grad) for k, v in clean.items()}
    return finite, bad


def _same(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what} {k}")
        return
    if isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{what}[{i}]")
        return
    if isinstance(a, float):
        assert math.isfinite(b) and b == pytest.approx(a, rel=1e-6, abs=1e-9), f"{what}: {b} != {a}"
        return
    assert torch.isfinite(b).all(), f"{what} is not finite: {b}"
    torch.testing.assert_close(b, a, msg=lambda m: f"{what}: {m}")


def _grads(out: torch.Tensor, inputs: dict, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, [inputs[n] for n in names])


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("extras", [False, True], ids=["adv_b", "adv_bt+is_weight+prox"])
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_ignore_non_finite_padding(name, extras, padding):
    results = []
    for inputs in _both(0, padding, grad=("logp",)):
        kwargs = {}
        adv = torch.tensor([1.0, -0.5, 2.0, 0.3])
        if extras:
            adv = inputs["adv"]
            kwargs["is_weight_bt"] = inputs["w"]
            if name == "decoupled_ppo":
                kwargs["prox_logp_bt"] = inputs["prox"]
        torch.manual_seed(0)  # clip_cov draws its detached tokens at random
        loss, metrics = POLICY_LOSSES[name](inputs["logp"], inputs["old"], adv, MASK, **kwargs)
        (grad,) = _grads(loss, inputs, ("logp",))
        results.append((loss, grad, metrics))
    (loss0, grad0, metrics0), (loss1, grad1, metrics1) = results
    _same(loss0, loss1, "loss")
    _same(grad0, grad1, "grad")
    assert torch.equal(grad1[PAD], torch.zeros(int(PAD.sum()))), "padding got gradient"
    assert grad1[~PAD].abs().sum() > 0, "no gradient on the response tokens"
    _same(metrics0, metrics1, "metrics")


CORRECTION_KNOBS = [
    {},
    {"tis_level": "sequence", "mis_level": "sequence"},
    {"tis_level": "geometric", "mis_level": "geometric", "mis_low": 0.1, "mis_high": 10.0},
    {"rs_stat": "seq_max_k3", "rs_threshold": 0.5},
    {"rs_stat": "seq_mean_k2", "rs_threshold": 0.5, "is_batch_norm": True},
    {"rs_stat": "seq_max_ratio", "rs_threshold": 3.0},
    {"is_veto_threshold": 1e-4, "offpolicy_mask_delta": 0.1},
]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("knobs", CORRECTION_KNOBS, ids=lambda k: ",".join(k) or "defaults")
@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_corrections_ignore_non_finite_padding(name, knobs, padding):
    from tidal.algo.config import bind

    if name == "reject" and not {"rs_stat", "is_veto_threshold", "offpolicy_mask_delta"} & set(knobs):
        knobs = {**knobs, "rs_stat": "token_k2", "rs_threshold": 0.05}
    results = []
    for inputs in _both(1, padding):
        fn = bind(CORRECTIONS[name], None, **knobs, adv=inputs["adv"])
        results.append(fn(inputs["old"], inputs["logp"], MASK))
    _same(results[0], results[1], f"{name} {knobs}")
    assert torch.equal(results[1][0][PAD], torch.zeros(int(PAD.sum())))


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimators_ignore_non_finite_padding(name, padding):
    results = []
    for inputs in _both(2, padding, grad=("logp",)):
        loss, metrics = kl_loss(inputs["logp"], inputs["ref"], MASK, kl_estimator=name, behav_logp_bt=inputs["old"])
        (grad,) = _grads(loss, inputs, ("logp",))
        penalty_bt = kl_reward_penalty_tokens(inputs["old"], inputs["ref"], MASK, kl_estimator=name)
        penalty_b = kl_reward_penalty(inputs["old"], inputs["ref"], MASK, kl_estimator=name)
        results.append((loss, grad, metrics, penalty_bt, penalty_b))
    _same(results[0], results[1], name)
    assert torch.equal(results[1][1][PAD], torch.zeros(int(PAD.sum()))), "padding got gradient"


@pytest.mark.parametrize("padding", PADDINGS)
def test_the_other_masked_functions_ignore_non_finite_padding(padding):
    """Entropy bonus and high-entropy mask, value loss, GAE, explained variance, REINFORCE++'s token-level
    returns, distillation advantage, covariance, the masked mean, sequence log-ratio and advantage metrics:
    all the other users of a response mask in algo/."""
    results = []
    for inputs in _both(3, padding, grad=("x", "logp")):
        out = {}
        bonus, out["entropy_metrics"] = entropy_loss(inputs["x"], MASK, entropy_coef=0.1)
        vloss, out["value_metrics"] = value_loss(inputs["logp"], inputs["old"], inputs["ref"], MASK)
        out["grads"] = torch.autograd.grad(bonus + vloss, [inputs["x"], inputs["logp"]])
        rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
        out["gae"] = gae(rewards, inputs["old"], MASK)
        out["explained_var"] = explained_variance(inputs["old"], inputs["ref"], MASK)
        out["top_entropy"] = high_entropy_mask(inputs["x"].detach(), MASK, top_entropy_frac=0.5)
        out["rpp_token"] = ADVANTAGES["reinforce_pp_token"](rewards, torch.tensor([0, 0, 1, 1]), mask_bt=MASK,
                                                             kl_penalty_bt=inputs["w"], gamma=0.9)
        out["distill"] = distill_advantage(torch.ones(B), inputs["ref"], inputs["old"], MASK, distill_reward_coef=0.5)
        out["distill_bt"] = distill_advantage(inputs["adv"], inputs["ref"], inputs["old"], MASK)
        out["cov"] = token_covariance(inputs["logp"], inputs["adv"], MASK)
        out["masked_mean"] = masked_mean(inputs["x"].detach(), MASK)
        out["seq_log_ratio"] = sequence_log_ratio(inputs["old"], inputs["logp"].detach(), MASK)
        out["adv_metrics"] = advantage_metrics(inputs["adv"], MASK)
        results.append(out)
    _same(results[0], results[1], padding)
    for grad in results[1]["grads"]:
        assert torch.equal(grad[PAD], torch.zeros(int(PAD.sum()))), "padding got gradient"
    assert torch.equal(results[1]["distill"][PAD], torch.zeros(int(PAD.sum())))
