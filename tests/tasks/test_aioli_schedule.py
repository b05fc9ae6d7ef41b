"""Aioli's task-mixture schedule on a hand example: the sweeps' weights, the gains read one step late,
the update, and when the new proportions take effect."""

import math

import pytest

from tidal.config import ConfigError
from tidal.tasks.aioli import AioliSchedule, AioliScheduleConfig

CFG = AioliScheduleConfig(update_steps=6, lp_rounds=1, lp_steps=1, eta=1.0, one_hot_factor=0.75)


def test_a_round_by_hand():
    s = AioliSchedule(2, [1.0, 1.0], CFG, seed=0)
    first, second = s.order(0)
    assert sorted([first, second]) == [0, 1]
    # steps 0 and 1 sweep the tasks (0.75 on the swept one), steps 2-5 train on the proportions
    assert s.weights_at(0) == [0.75 if i == first else 0.25 for i in range(2)]
    assert s.weights_at(1) == [0.75 if i == second else 0.25 for i in range(2)]
    assert s.weights_at(2) == [0.5, 0.5]
    # mean rewards: the step after sweeping task 0 shows task 0 up 0.3, the step after task 1 task 1 up 0.1
    r = {0: 0.2, 1: 0.2}
    s.observe({0: [r[0]], 1: [r[1]]}, first_free_step=1)  # step 0: before the first sweep's update
    r[first] += 0.3 if first == 0 else 0.0
    r[1] += 0.1 if first == 1 else 0.0
    s.observe({0: [r[0]], 1: [r[1]]}, first_free_step=2)
    r[second] += 0.3 if second == 0 else 0.1
    s.observe({0: [r[0]], 1: [r[1]]}, first_free_step=3)  # step 2: the second sweep's gain is in
    # gains [[0.3, 0], [0, 0.1]]; W = [[.75, .25], [.25, .75]] -> A = [[.45, -.15], [-.05, .15]];
    # shift by .15 -> [[.6, 0], [.1, .3]] (sum 1); column sums (.7, .3); p0 = 1 / (1 + e^-0.4)
    p0 = 1 / (1 + math.exp(-0.4))
    assert s.proportions == pytest.approx([p0, 1 - p0])
    assert s.history[-1][0] == 3, "the new proportions apply from the first step not yet drawn"
    assert s.weights_at(2) == [0.5, 0.5] and s.weights_at(3) == pytest.approx([p0, 1 - p0])
    # the next round sweeps again, then uses the new proportions
    assert max(s.weights_at(6)) == 0.75 and s.weights_at(8) == pytest.approx([p0, 1 - p0])


def test_a_task_missing_from_a_step_keeps_its_last_value_and_state_round_trips():
    s = AioliSchedule(2, [3.0, 1.0], CFG, seed=1)
    assert s.weights_at(2) == [0.75, 0.25], "the prior is the components' normalised weights"
    s.observe({0: [0.1, 0.3], 1: [0.0]}, 1)
    s.observe({0: [0.4]}, 2)  # task 1 drew no group: no gain for it
    t = AioliSchedule(2, [3.0, 1.0], CFG, seed=1)
    t.load_state_dict(s.state_dict())
    for one in (s, t):
        one.observe({1: [0.5]}, 3)
    assert s.state_dict() == t.state_dict()
    assert s.last == [0.4, 0.5]


def test_learnparams_must_fit_in_a_round():
    with pytest.raises(ConfigError, match="update_steps=4 must be larger"):
        AioliSchedule(2, [1, 1], AioliScheduleConfig(update_steps=4, lp_rounds=1, lp_steps=2), 0)
    with pytest.raises(ConfigError, match="one_hot_factor=0.5"):
        AioliSchedule(2, [1, 1], AioliScheduleConfig(one_hot_factor=0.5), 0)
