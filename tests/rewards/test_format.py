import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.types import Prompt

P = Prompt("u", "What is 2+3?", "5")


def fmt(response, **params):
    return build_reward("format", params)(response, P)


def test_magistral_math_format_passes():
    reward, details = fmt("<think>\n2+3 = 5\n</think>\nThe sum is \\boxed{5}.")
    assert reward == 1.0 and details == {"passed": {"think": True, "boxed": True}, "reason": "ok"}
    assert fmt("  \n<think>x</think>\\boxed{5}")[0] == 1.0  # leading whitespace is fine


@pytest.mark.parametrize(
    "response,reason",
    [
        ("2+3 = 5 </think> \\boxed{5}", "does not start with <think>"),
        ("Sure! <think>x</think> \\boxed{5}", "does not start with <think>"),
        ("<think>a</think><think>b</think> \\boxed{5}", "exactly one"),
        ("<think>a <think> b</think> \\boxed{5}", "exactly one"),
        ("<think>a</think> b </think> \\boxed{5}", "exactly one"),
        ("<think>2+3 = \\boxed{5}", "exactly one"),  # unclosed (truncated)
        ("<think>  </think> \\boxed{5}", "empty thoughts"),
        ("<think>2+3 = 5</think>   ", "empty answer"),
        ("<think>\\boxed{5}</think> It is five.", "no non-empty \\boxed{}"),  # boxed only in the thoughts
        ("<think>x</think> \\boxed{ }", "no non-empty \\boxed{}"),
    ],
)
def test_math_format_failures_name_the_reason(response, reason):
    reward, details = fmt(response)
    assert reward == 0.0
    assert reason in details["reason"], details


def test_checks_are_configurable():
    assert fmt("\\boxed{5}", checks=["boxed"])[0] == 1.0  # no think required
    assert fmt("<think>x</think> five", checks=["think"])[0] == 1.0  # no box required
    reward, details = fmt("<think>x</think> five", checks=["think", "boxed"])
    assert details["passed"] == {"think": True, "boxed": False}
    with pytest.raises(ConfigError, match="checks"):
        build_reward("format", {"checks": ["xml"]})


def test_code_format():
    code = "<think>plan</think>\nHere:\n```python\nprint(5)\n```\n"
    assert fmt(code, checks=["think", "code"])[0] == 1.0
    no_lang = "<think>plan</think>\n```\nprint(5)\n```"
    reward, details = fmt(no_lang, checks=["think", "code"])
    assert reward == 0.0 and "language" in details["reason"]
    assert fmt(no_lang, checks=["think", "code"], code_lang=False)[0] == 1.0
    assert fmt("<think>```python\nx\n```</think> no code here", checks=["code"])[1]["reason"].startswith("no fenced")
    assert fmt("<think>p</think>\n```python\nprint(5)", checks=["code"])[0] == 0.0  # unclosed fence
