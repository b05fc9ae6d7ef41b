"""``by_task`` routing, lowering a composed term's weight, and the length-bias hook."""

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.monitor import LengthBiasConfig, LengthBiasHook
from tidal.types import Prompt


def test_each_prompt_is_scored_by_its_tasks_reward():
    fn = build_reward("by_task", {"routes": {"add": {"name": "exact_match"}, "digits": {"name": "digit_match"}}})
    add, digits = Prompt("a", "1+2=", "13", {"task": "add"}), Prompt("d", "1+2=", "13", {"task": "digits"})
    assert fn("12", add) == (0.0, {"task": "add", **fn._fns["add"]("12", add)[1]})
    reward, details = fn("12", digits)
    assert reward == pytest.approx(0.5) and details["task"] == "digits"  # one of two digits right
    reward, details = fn("13", Prompt("x", "1+2=", "13", {"task": "other"}))
    assert reward == 0.0 and "no route" in details["error"] and "other" in details["error"]
    with pytest.raises(ConfigError, match=r"routes\['add'\] must be"):
        build_reward("by_task", {"routes": {"add": "exact_match"}})


def test_lowering_a_composed_terms_weight():
    fn = build_reward("compose", {"terms": [{"reward": "exact_match", "weight": 0.9},
                                            {"reward": "digit_match", "name": "judge", "weight": 0.4}]})
    p = Prompt("a", "1+2=", "13")
    assert fn("13", p)[0] == pytest.approx(1.3)
    assert fn.scale_component("judge", 0.5) and fn.weight("judge") == pytest.approx(0.2)
    assert fn("13", p)[0] == pytest.approx(1.1)
    assert not fn.scale_component("missing", 0.5)
    routed = build_reward("by_task", {"routes": {"t": {"name": "compose", "params": {
        "terms": [{"reward": "digit_match", "name": "judge"}]}}}})
    assert routed.scale_component("judge", 0.25) and routed._fns["t"].weight("judge") == 0.25


def test_length_bias_hook_fires_after_patience_and_restarts():
    hook = LengthBiasHook(LengthBiasConfig(component="judge", threshold=0.3, patience=2, action="stop"))
    key = "reward/judge/length_corr"
    assert hook.check(1, {key: 0.5}) is None  # one step above
    assert hook.check(2, {key: 0.1}) is None  # below: the streak restarts
    assert hook.check(3, {key: 0.5}) is None
    message = hook.check(4, {key: 0.31})
    assert message is not None and "step 4" in message and "action stop" in message and hook.fired == 1
    assert hook.check(5, {}) is None and hook.streak == 0  # no correlation logged (constant side)
    again = LengthBiasHook(hook.cfg)
    again.load_state_dict(hook.state_dict())
    assert again.state_dict() == {"streak": 0, "fired": 1}
