import math
import pickle

import pytest

from tidal.config import ConfigError
from tidal.rewards import REWARDS, build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.types import Prompt

P = Prompt("u", "What is 2+3?", "5", {"num_tokens": 14})
GOOD = "<think>2+3 = 5</think> The sum is \\boxed{5}."
MAGISTRAL = {
    "terms": [
        {"reward": "math", "weight": 0.9},
        {"reward": "format", "weight": 0.1},
        {"reward": "length", "weight": 1.0, "params": {"max_len": 20, "cache_len": 8}},
    ],
    "gates": [{"reward": "format", "min": 1.0}],
}


def _boom(response, prompt):
    raise RuntimeError("verifier crashed")


def _nan(response, prompt):
    return math.nan, {}


def _reports_error(response, prompt):
    return 0.0, {"error": "sandbox unavailable"}


@pytest.fixture
def broken_rewards(monkeypatch):
    """Rewards that fail in each way, registered for one test only (the registry is global)."""
    for name, fn in [("test_boom", _boom), ("test_nan", _nan), ("test_error", _reports_error)]:
        monkeypatch.setitem(REWARDS._items, name, lambda fn=fn: fn)


def test_weighted_sum_hand_computed():
    # math 1 * 0.9 + format 1 * 0.1 + length (12 - 14) / 8 = -0.25 -> 0.75
    reward, details = build_reward("compose", MAGISTRAL)(GOOD, P)
    assert reward == pytest.approx(0.75)
    assert details["components"] == {"format": 1.0, "math": 1.0, "length": -0.25}
    assert details["gates"] == {"format": True} and details["reason"] == "ok"
    assert details["component_details"]["math"]["extracted"] == "5"
    assert details["component_details"]["length"]["length"] == 14
    assert "error" not in details
    # Wrong answer, right format: 0.9 * 0 + 0.1 * 1 - 0.25
    assert build_reward("compose", MAGISTRAL)(GOOD.replace("{5}", "{6}"), P)[0] == pytest.approx(-0.15)


def test_failed_gate_gives_the_floor_and_skips_the_rest():
    reward, details = build_reward("compose", MAGISTRAL)("The sum is \\boxed{5}.", P)  # no think block
    assert reward == 0.0
    assert details["gates"] == {"format": False}
    assert details["reason"] == "gate 'format' failed: 0 not in [1, inf]"
    assert details["components"] == {"format": 0.0}  # math and length were not scored
    floored = build_reward("compose", {**MAGISTRAL, "floor": -1.0})("The sum is \\boxed{5}.", P)
    assert floored[0] == -1.0


def test_gate_with_max_and_its_own_params():
    params = {
        "terms": [{"reward": "math"}],
        "gates": [{"reward": "length", "max": -0.5, "params": {"max_len": 20, "cache_len": 8}}],
    }
    fn = build_reward("compose", params)
    assert fn(GOOD, P)[0] == 0.0  # length -0.25 > max -0.5: gate fails
    assert fn(GOOD, Prompt("u", P.text, "5", {"num_tokens": 18}))[0] == 1.0  # -0.75 passes


def test_named_terms_distinguish_two_of_the_same_reward():
    params = {
        "terms": [
            {"reward": "math", "name": "math_strict", "weight": 1.0},
            {"reward": "math", "name": "math_lenient", "weight": 0.5, "params": {"mode": "lenient"}},
        ]
    }
    reward, details = build_reward("compose", params)("2 + 3 makes 5", P)
    assert reward == 0.5 and details["components"] == {"math_strict": 0.0, "math_lenient": 1.0}


def test_a_raising_component_scores_zero_and_the_error_is_visible(broken_rewards):
    params = {"terms": [{"reward": "math", "weight": 1.0}, {"reward": "test_boom", "weight": 1.0}]}
    reward, details = build_reward("compose", params)(GOOD, P)
    assert reward == 1.0  # math still counts
    assert details["components"] == {"math": 1.0, "test_boom": 0.0}
    assert details["error"] == "test_boom: RuntimeError: verifier crashed"
    pool = RewardPool(build_reward("compose", params), RewardConfig(num_workers=0))
    pool.score([(GOOD, P)])
    assert pool.num_errors == 1  # counted, never silent


def test_non_finite_and_reported_errors_propagate(broken_rewards):
    params = {"terms": [{"reward": "test_nan"}, {"reward": "test_error"}, {"reward": "exact_match"}]}
    reward, details = build_reward("compose", params)("5", P)
    assert reward == 1.0 and details["components"]["test_nan"] == 0.0
    assert details["error"] == "test_nan: non-finite score nan; test_error: sandbox unavailable"


def test_config_errors():
    with pytest.raises(ConfigError, match="at least one term"):
        build_reward("compose", {"terms": []})
    with pytest.raises(ConfigError, match="distinct"):
        build_reward("compose", {"terms": [{"reward": "math"}, {"reward": "math"}]})
    with pytest.raises(ConfigError, match="unknown keys"):
        build_reward("compose", {"terms": [{"reward": "math", "wieght": 1}]})
    with pytest.raises(ConfigError, match="weight must be a number"):
        build_reward("compose", {"terms": [{"reward": "math", "weight": "high"}]})
    with pytest.raises(ConfigError, match="min"):
        build_reward("compose", {"terms": [{"reward": "math"}], "gates": [{"reward": "format"}]})
    with pytest.raises(ConfigError, match="differs"):
        build_reward(
            "compose",
            {
                "terms": [{"reward": "format"}],
                "gates": [{"reward": "format", "min": 1, "params": {"checks": ["code"]}}],
            },
        )
    with pytest.raises(ConfigError, match="mode"):  # a child's bad params surface at build time
        build_reward("compose", {"terms": [{"reward": "math", "params": {"mode": "x"}}]})
    with pytest.raises(KeyError, match="no_such_reward"):
        build_reward("compose", {"terms": [{"reward": "no_such_reward"}]})


def test_pickles_and_runs_in_a_worker_process():
    fn = build_reward("compose", MAGISTRAL)
    assert pickle.loads(pickle.dumps(fn))(GOOD, P)[0] == pytest.approx(0.75)
    pool = RewardPool(fn, RewardConfig(num_workers=1, timeout_s=60))
    try:
        (reward, details), (bad, _) = pool.score([(GOOD, P), ("\\boxed{5}", P)])
    finally:
        pool.close()
    assert reward == pytest.approx(0.75) and bad == 0.0 and details["components"]["math"] == 1.0
