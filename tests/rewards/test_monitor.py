import pytest

from tidal.rewards.monitor import pearson, reward_metrics


def test_pearson_hand_computed():
    # x = 1,2,3; y = 2,4,7: mx=2, my=13/3; sxy = (-1)(-7/3)+0+(1)(8/3) = 5; sxx = 2; syy = 49/9+1/9+64/9 = 114/9
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(5 / (2 * 114 / 9) ** 0.5)
    assert pearson([1, 1, 1], [1, 2, 3]) is None
    assert pearson([1], [1]) is None


def test_component_means_and_length_bias():
    details = [{"components": {"judge": 0.0, "format": 1.0}}, {"components": {"judge": 1.0, "format": 1.0}}, {}]
    out = reward_metrics([0.0, 1.0, 0.5], details, [10, 20, 15])
    assert out["reward/judge/mean"] == 0.5 and out["reward/format/mean"] == 1.0
    assert out["reward/judge/std"] == 0.5 and out["reward/format/std"] == 0.0  # population std of [0, 1], [1, 1]
    assert out["reward/std"] == pytest.approx((1 / 6) ** 0.5)  # [0, 1, 0.5]: mean 0.5, variance (0.25+0.25+0)/3
    assert out["reward/judge/length_corr"] == pytest.approx(1.0)  # judge rewards the longer answer
    assert "reward/format/length_corr" not in out  # constant: undefined, left out
    assert out["reward/length_corr"] == pytest.approx(1.0)
