"""Each preference loss against numbers worked out by hand (TRL parity: test_trl_parity.py).

One pair: policy log-probs chosen -3, rejected -5; reference -4 and -4; completions of 2 and 4 tokens.
Log-ratio margin h = (-3 + 4) - (-5 + 4) = 2."""

import math

import pytest
import torch

from tidal.stages.dpo_losses import PREFERENCE_LOSSES, implicit_margin

PC, PR, RC, RR, NC, NR = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.0, 2.0, 4.0))


@pytest.mark.parametrize("name, beta, gamma, expected", [
    ("sigmoid", 0.5, 0.0, math.log(1 + math.exp(-1))),  # -log sigmoid(0.5 * 2)
    ("hinge", 0.25, 0.0, 0.5),  # max(0, 1 - 0.25 * 2)
    ("hinge", 0.5, 0.0, 0.0),  # the margin reached: no loss
    ("ipo", 0.5, 0.0, 0.0625),  # per-token margin 1/2 + 1/4 = 0.75; (0.75 - 1/(2*0.5))^2
    ("simpo", 2.0, 0.5, math.log(1 + math.e)),  # 2 * (-3/2 + 5/4) - 0.5 = -1; -log sigmoid(-1)
])
def test_loss_matches_hand_computation(name, beta, gamma, expected):
    got = PREFERENCE_LOSSES.get(name)(PC, PR, RC, RR, NC, NR, beta, gamma)
    assert got.shape == (1,) and abs(float(got) - expected) < 1e-6, (name, float(got), expected)


def test_policy_equal_to_reference_gives_log_2():
    """At DPO's first step the policy is the reference: h = 0, so the loss is -log sigmoid(0) = log 2."""
    got = PREFERENCE_LOSSES.get("sigmoid")(PC, PR, PC, PR, NC, NR, 0.1)
    assert abs(float(got) - math.log(2)) < 1e-7


def test_implicit_margin():
    assert float(implicit_margin("sigmoid", PC, PR, RC, RR, NC, NR)) == 2.0
    assert float(implicit_margin("simpo", PC, PR, RC, RR, NC, NR)) == -0.25  # -3/2 - (-5/4): simpo prefers rejected


def test_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
    PREFERENCE_LOSSES.get("sigmoid")(pc, pr, RC, RR, NC, NR, 0.5).sum().backward()
    s = 1 / (1 + math.exp(1))  # d/dh of -log sigmoid(beta h) = -beta sigmoid(-beta h)
    assert abs(float(pc.grad) + 0.5 * s) < 1e-7 and abs(float(pr.grad) - 0.5 * s) < 1e-7
