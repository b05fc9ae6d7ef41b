import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.length import overlong_penalty
from tidal.types import Prompt


def test_overlong_penalty_hand_computed():
    # L_max = 20, L_cache = 8: no penalty up to 12, then (12 - |y|) / 8, then -1 past 20 (DAPO eq. 13).
    assert overlong_penalty(0, 20, 8) == 0.0
    assert overlong_penalty(12, 20, 8) == 0.0
    assert overlong_penalty(13, 20, 8) == -0.125
    assert overlong_penalty(16, 20, 8) == -0.5
    assert overlong_penalty(20, 20, 8) == -1.0
    assert overlong_penalty(21, 20, 8) == -1.0
    # DAPO's values: 16384 free tokens, then a 4096-token ramp.
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(18432, 20480, 4096) == -0.5
    assert overlong_penalty(20481, 20480, 4096) == -1.0
    with pytest.raises(AssertionError):
        overlong_penalty(5, 20, 0)


def test_length_reward_uses_num_tokens_else_fallback():
    fn = build_reward("length", {"max_len": 20, "cache_len": 8})
    expected = (-0.25, {"length": 14, "unit": "tokens", "soft_start": 12})  # (12 - 14) / 8
    assert fn("a b c", Prompt("u", "q", "", {"num_tokens": 14})) == expected
    words = " ".join(["w"] * 16)  # 16 words, 31 characters
    assert fn(words, Prompt("u", "q", ""))[0] == -0.5  # (12 - 16) / 8
    assert fn(words, Prompt("u", "q", ""))[1]["unit"] == "words"
    chars = build_reward("length", {"max_len": 40, "cache_len": 8, "fallback": "chars"})
    assert chars(words, Prompt("u", "q", "")) == (0.0, {"length": 31, "unit": "chars", "soft_start": 32})
    assert chars(words + "xx", Prompt("u", "q", ""))[0] == pytest.approx((32 - 33) / 8)


def test_defaults_are_dapos_and_bad_params_fail():
    fn = build_reward("length", {})
    assert (fn.max_len, fn.cache_len) == (20480, 4096)
    assert fn("short", Prompt("u", "q", "", {"num_tokens": 100}))[0] == 0.0
    with pytest.raises(ConfigError):
        build_reward("length", {"max_len": 10, "cache_len": 20})
    with pytest.raises(ConfigError):
        build_reward("length", {"fallback": "bytes"})
