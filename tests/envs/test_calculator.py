"""The calculator environment (safe arithmetic by ``ast`` walk, episodes, the warm-start trace) and
the tool-call parser it shares with the other environments (tagged and hermes formats)."""

from fractions import Fraction

import pytest

from tidal.envs import ENVS
from tidal.envs.calculator import MAX_ABS, CalcError, Calculator, calculator_trace, evaluate, same_number
from tidal.envs.tool_calls import Answer, CallFormat, Malformed, ToolCall, make_call_format
from tidal.types import Prompt


def _env(answer: str = "102", **params) -> Calculator:
    env = ENVS.get("calculator")(**params)
    assert env.reset(Prompt("p0", "12+34+56=", answer)) is None
    return env


@pytest.mark.parametrize("expression, value", [
    ("12+34", 46), ("(1+2)*3", 9), ("-4+10", 6), ("+5", 5), (" 2 * 3 ", 6), ("7/2", Fraction(7, 2)),
    ("7//2", 3), ("7%3", 1), ("-(3-5)", 2), (str(MAX_ABS), MAX_ABS), (f"-{MAX_ABS}", -MAX_ABS),
])  # fmt: skip
def test_evaluate_allowed(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os')", "Call is not allowed"),
    ("2**3", "not allowed"),  # no powers: 2**10**10 cannot be written
    ("x+1", "Name is not allowed"),
    ("1.5+1", "Constant is not allowed"),
    ("True+1", "Constant is not allowed"),  # bool is not an int here
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("'a'*3", "Constant is not allowed"),
    (f"{MAX_ABS}+1", "out of range"),
    ("999999999*999999999", "out of range"),
    (f"{MAX_ABS}*2/2", "out of range"),  # every intermediate value is bounded, not only the result
    ("9" * 30, "out of range"),
    ("1/0", "division by zero"), ("1//(2-2)", "division by zero"), ("5%0", "division by zero"),
    ("1+" * 100 + "1", "longer than 200"),
    ("", "not an expression"), ("1+", "not an expression"), ("1;2", "not an expression"),
])  # fmt: skip
def test_evaluate_forbidden(expression, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


@pytest.mark.parametrize("text, answer, same", [
    ("052", "52", True), (" 46 ", "46", True), ("3.0", "3", True), ("0.5", "1/2", True), ("-7", "-7", True),
    ("46", "47", False), ("abc", "abc", True), ("abc", "abd", False), ("46.", "x", False), ("1/0", "1/0", True),
])  # fmt: skip
def test_same_number(text, answer, same):
    assert same_number(text, answer) is same


def test_episode_calls_then_right_answer():
    env = _env()
    assert env.stop == ["</c>"]
    assert env.step("<c>12+34</c>") == _step("=46 ", tool_call=True)
    assert env.step("<c>46+56</c>") == _step("=102 ", tool_call=True)
    assert env.step("<c>7/2</c>") == _step("=3.5 ", tool_call=True)
    assert env.step("<c>1/0</c>") == _step("=error ", tool_call=True, tool_error=True)
    assert env.step("<c>__import__('os')</c>") == _step("=error ", tool_call=True, tool_error=True)
    final = env.step(" 102")
    assert (final.observation, final.reward, final.done, final.info) == (None, 1.0, True, {"correct": True})


def test_wrong_answer_ends_with_zero():
    final = _env().step("101")
    assert (final.observation, final.reward, final.done, final.info) == (None, 0.0, True, {"correct": False})


def test_malformed_unclosed_call():
    assert _env().step("<c>12+34") == _step("=error ", malformed=True)


def test_timeout_observation_and_result_wrapping():
    env = _env(result_open="[", result_close="]")
    assert env.timeout_observation() == "[timeout]"
    assert env.step("<c>2+2</c>").observation == "[4]"


def test_trace():
    assert calculator_trace([12, 34, 56]) == "<c>12+34</c>=46 <c>46+56</c>=102 102"


def test_trace_replays_as_an_episode():
    """Each call in the trace, fed back to the environment, gets the observation the trace shows."""
    env, text = _env(), calculator_trace([12, 34, 56])
    call, rest = text.split("</c>", 1)
    assert env.step(call + "</c>").observation == rest[: len("=46 ")]


def test_hermes_format():
    env = _env("3", call_format="hermes")
    assert env.stop == ["</tool_call>"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    assert env.step(call) == _step("=3 ", tool_call=True)
    other_tool = '<tool_call>{"name": "search", "arguments": {"query": "1+2"}}</tool_call>'
    assert env.step(other_tool) == _step("=error ", malformed=True)
    assert env.step("<tool_call>{not json}</tool_call>") == _step("=error ", malformed=True)
    assert env.step("3").reward == 1.0
    trace = calculator_trace([1, 2], _env(call_format="hermes"))
    assert trace == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>=3 3'


def test_unknown_call_format():
    with pytest.raises(ValueError, match="unknown call_format"):
        Calculator(call_format="xml")


# ---- tool_calls.py --------------------------------------------------------------------------------
HERMES = CallFormat.hermes("calculator", "expression")


def _hermes(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


@pytest.mark.parametrize("body, parsed", [
    ('{"name": "calculator", "arguments": {"expression": "1+2"}}', ToolCall("calculator", {"expression": "1+2"})),
    ('\n {"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"} \n',
     ToolCall("calculator", {"expression": "1+2"})),  # arguments as a JSON string
    ('{"name": "calculator"}', ToolCall("calculator", {})),
    ('{"name": "calculator", "arguments": {}}', ToolCall("calculator", {})),
])  # fmt: skip
def test_hermes_calls(body, parsed):
    assert HERMES.parse(_hermes(body)) == parsed


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calculator", "arguments": {"expression": "1+2"}', "call is not JSON"),
    ("", "call is not JSON"),
    ("[" * 100_000, "call is not JSON"),  # nested past the recursion limit: malformed, not a crash
    ('["calculator"]', "no tool name"),
    ('{"arguments": {"expression": "1+2"}}', "no tool name"),
    ('{"name": 3, "arguments": {}}', "no tool name"),
    ('{"name": "calculator", "arguments": "expression=1+2"}', "arguments are not JSON"),
    ('{"name": "calculator", "arguments": "' + "[" * 100_000 + '"}', "arguments are not JSON"),
    ('{"name": "calculator", "arguments": "[1, 2]"}', "not an object"),
    ('{"name": "calculator", "arguments": ["1+2"]}', "not an object"),
    ('{"name": "calculator", "arguments": null}', "not an object"),
    ('{"name": "calculator", "arguments": 3}', "not an object"),
])  # fmt: skip
def test_hermes_malformed(body, reason):
    parsed = HERMES.parse(_hermes(body))
    assert isinstance(parsed, Malformed) and reason in parsed.reason


def test_hermes_unclosed_and_answers():
    assert HERMES.parse('<tool_call>{"name": "calculator"}') == Malformed("unclosed call")
    assert HERMES.parse(" 46 \n") == Answer("46")
    assert HERMES.parse("</tool_call> 46") == Answer("</tool_call> 46")  # no opening tag: an answer


def test_tagged_parse():
    fmt = make_call_format("tagged", "calculator", "expression")
    assert fmt.parse("let me add <c>1+2</c> then") == ToolCall("calculator", {"expression": "1+2"})
    assert fmt.parse("<c></c>") == ToolCall("calculator", {"expression": ""})
    assert fmt.parse("<c>1+2") == Malformed("unclosed call")
    assert fmt.parse("</c>1+2") == Answer("</c>1+2")
    assert fmt.parse("") == Answer("")
    custom = CallFormat(open="<<", close=">>", tool="t", argument="a")
    call = ToolCall("t", {"a": "x y"})
    assert custom.parse(custom.render(call)) == call


def test_render_parse_round_trip_hermes():
    call = ToolCall("calculator", {"expression": 'a "quoted" </tool_call-ish'})
    assert HERMES.parse(HERMES.render(call)) == call


def _step(observation, **info):
    from tidal.api import EnvStep

    return EnvStep(observation, 0.0, False, info)


def test_same_number_never_builds_a_huge_integer():
    """An exponent in the answer must not be expanded (Fraction("1e999999999") holds the GIL for minutes)."""
    import time

    start = time.perf_counter()
    assert same_number("1e999999999", "100") is False and same_number("1e2", "100") is False
    assert same_number("9" * 41, "9" * 41) is True  # too long for a number: compared as text
    assert time.perf_counter() - start < 1.0


def test_zero_padded_operands_as_prompts_write_them():
    assert evaluate("07+45") == 52 and evaluate("(007)*10") == 70 and evaluate("100+0") == 100
    assert calculator_trace(["07", "45", "13"]) == "<c>07+45</c>=52 <c>52+13</c>=65 65"
