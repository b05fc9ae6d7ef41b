"""Online difficulty weighting: the weight formula by hand, draws that follow it, exact state round trip."""

import pytest

from tidal.tasks.online import DifficultySampler, OnlineDifficultyConfig, informative_probability, prompt_weight


def test_weight_formula_by_hand():
    assert informative_probability(0.5, 4) == 1 - 2 / 16  # 0.875
    assert informative_probability(0.25, 2) == pytest.approx(1 - 1 / 16 - 9 / 16)  # 0.375
    cfg = OnlineDifficultyConfig(floor=0.05)
    assert prompt_weight(0, 0, 4, cfg) == 1.0  # unseen: the prior 1/2, the peak
    assert prompt_weight(2, 8, 2, cfg) == pytest.approx(0.375 / 0.5)  # p = 1/4, G = 2
    assert prompt_weight(8, 8, 4, cfg) == 0.05  # always solved: the floor
    assert prompt_weight(0, 8, 4, cfg) == 0.05  # never solved: the floor
    assert prompt_weight(0, 0, 4, OnlineDifficultyConfig(prior=0.0, floor=0.2)) == 0.2


def test_decayed_counts_by_hand():
    s = DifficultySampler(3, 4, OnlineDifficultyConfig(decay=0.5), seed=0)
    s.observe(1, 4, 4)
    s.observe(1, 0, 4)
    assert (s.solved[1], s.seen[1]) == (2.0, 6.0)  # 0.5 * 4 + 0, 0.5 * 4 + 4
    s.observe(2, 1, 0)  # a group with no samples left (infrastructure failures) teaches nothing
    assert s.seen[2] == 0


def test_draws_favour_the_informative_band_with_a_floor():
    cfg = OnlineDifficultyConfig(floor=0.05)
    s = DifficultySampler(100, 8, cfg, seed=0)
    for i in range(50):  # the first half: always solved; the second half: half the time
        s.observe(i, 8, 8)
    for i in range(50, 100):
        s.observe(i, 4, 8)
    draws = [s.choose(i) for i in range(20000)]
    solved = sum(d < 50 for d in draws) / len(draws)
    w_mid = informative_probability(0.5, 8) / informative_probability(0.5, 8)
    expected = 50 * 0.05 / (50 * 0.05 + 50 * w_mid)  # 0.0476
    assert abs(solved - expected) < 0.01
    assert s.metrics() == {"seen_frac": 1.0, "pass_rate_mean": 0.75, "floor_frac": 0.5}


def test_state_round_trip_draws_the_same():
    cfg = OnlineDifficultyConfig()
    a = DifficultySampler(50, 4, cfg, seed=3, key="add")
    for i in range(0, 50, 3):
        a.observe(i, i % 5, 4)
    b = DifficultySampler(50, 4, cfg, seed=3, key="add")
    b.load_state_dict(a.state_dict())
    assert [a.choose(i) for i in range(500)] == [b.choose(i) for i in range(500)]
    assert [a.choose(i) for i in range(50)] != [DifficultySampler(50, 4, cfg, 3, "rep").choose(i) for i in range(50)]
    with pytest.raises(ValueError, match="pool of 50 prompts, but the task has 10"):
        DifficultySampler(10, 4, cfg, seed=3).load_state_dict(a.state_dict())
