"""Staged length growth by MiniMax-M1's indicator: quantile by hand, the stage change, exact state."""

from tidal.system.length_growth import LengthGrowth, LengthGrowthConfig, quantile


def test_nearest_rank_quantile_by_hand():
    assert quantile(list(range(1, 101)), 0.99) == 99
    assert quantile(list(range(1, 101)), 1.0) == 100
    assert quantile([5, 1, 3], 0.5) == 3
    assert quantile([7], 0.99) == 7


def test_grows_when_p99_reaches_the_cap_over_the_window():
    g = LengthGrowth(LengthGrowthConfig(stages=[10, 20, 40], window=2, quantile=0.99, within=0.1))
    assert g.cap == 10
    assert g.observe(1, [10] * 100) is None  # one step: the window is not full yet
    assert g.observe(2, [5] * 100) is not None  # 200 pooled, half at 10: rank 198 is 10 >= 9
    assert g.cap == 20 and g.window == []  # the window restarts with the stage
    assert g.observe(3, [20] * 100) is None  # the new stage runs at least `window` steps


def test_stage_change_message_and_state():
    g = LengthGrowth(LengthGrowthConfig(stages=[10, 20], window=2, within=0.1))
    assert g.observe(1, [3] * 99 + [10]) is None
    msg = g.observe(2, [3] * 98 + [9, 9])  # pooled 200 values: rank 198 is 9 >= 0.9 * 10
    assert msg is not None and "cap 10 -> 20" in msg and "after step 2" in msg
    assert g.metrics() == {"rollout/length_stage": 1.0, "rollout/length_cap": 20.0}
    assert g.observe(3, [20] * 10) is None  # the last stage never grows
    h = LengthGrowth(g.cfg)
    h.load_state_dict(g.state_dict())
    assert (h.stage, h.window) == (g.stage, g.window)


def test_does_not_grow_below_the_margin():
    g = LengthGrowth(LengthGrowthConfig(stages=[10, 20], window=1, within=0.1))
    assert g.observe(1, [3] * 98 + [8, 10]) is None  # p99 = rank 99 of 100 = 8 < 9
    assert g.stage == 0
