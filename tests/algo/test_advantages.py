import math

import pytest
import torch

from tidal.algo import ADVANTAGES
from tidal.algo.config import AlgoConfig


def test_grpo_matches_hand_computed():
    # Group rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(((.5^2)*4)/3) = sqrt(1/3).
    adv, _ = ADVANTAGES.get("grpo")(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), AlgoConfig(adv_eps=0.0))
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([[0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]]))


def test_grpo_equal_rewards_give_zero_not_nan():
    adv, _ = ADVANTAGES.get("grpo")(torch.tensor([[1.0, 1.0, 1.0]]), AlgoConfig())
    assert torch.equal(adv, torch.zeros(1, 3))


def test_grpo_groups_are_independent():
    # Second group [3, 1]: mean 2, std sqrt(2) -> +-1/sqrt(2)
    adv, _ = ADVANTAGES.get("grpo")(torch.tensor([[0.0, 1.0], [3.0, 1.0]]), AlgoConfig(adv_eps=0.0))
    r = 1 / math.sqrt(2)
    assert torch.allclose(adv, torch.tensor([[-r, r], [r, -r]]))


def test_dr_grpo_is_mean_centred_only():
    adv, _ = ADVANTAGES.get("dr_grpo")(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), AlgoConfig())
    assert torch.allclose(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_unknown_estimator_lists_close_matches():
    with pytest.raises(KeyError, match="grpo"):
        ADVANTAGES.get("gpro")
