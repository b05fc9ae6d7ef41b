"""The python_tool environment: calls run in the sandbox (output, errors, timeouts, stateful replay),
answers end the episode. Each call starts a sandbox (~50 ms); the timeout test waits 1 s."""

import pytest

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.envs.python_tool import PythonTool, replay_program
from tidal.rewards.sandbox import isolation_status
from tidal.types import Prompt

ISOLATED, _ = isolation_status()


def _env(answer: str = "42", **params) -> PythonTool:
    env = ENVS.get("python_tool")(allow_unisolated=not ISOLATED, **params)
    assert env.reset(Prompt("p0", "what is 6*7?", answer)) is None
    return env


def _call(observation: str, **info) -> EnvStep:
    return EnvStep(observation, 0.0, False, {"tool_call": True, **info})


def test_call_prints_a_value():
    env = _env()
    assert env.stop == ["</py>"]
    assert env.step("let me compute <py>print(6*7)</py>") == _call("<out>42\n</out>")
    assert env.step("<py>x = 1</py>") == _call("<out></out>")  # printed nothing


def test_output_is_truncated():
    env = _env(max_output_chars=5, result_open="[", result_close="]")
    assert env.step("<py>print('abcdefgh')</py>") == _call("[abcde]")


def test_raising_call_is_a_tool_error():
    env = _env()
    assert env.step("<py>1/0</py>") == _call("<out>ZeroDivisionError: division by zero</out>", tool_error=True)
    assert env.step("<py>import os; os.system('ls')</py>").info == {"tool_call": True}  # contained, not refused
    step = env.step("<py>def f(:</py>")
    assert step.info["tool_error"] and step.observation.startswith("<out>SyntaxError")
    assert env.step("<py>import sys; sys.exit(3)</py>") == _call("<out>exit code 3</out>", tool_error=True)
    flood = _call("<out>output limit exceeded</out>", tool_error=True)
    assert env.step("<py>while True: print('x' * 10000)</py>") == flood


def test_timing_out_call():
    env = _env(timeout_s=1)
    assert env.step("<py>while True: pass</py>") == _call("<out>timeout after 1s</out>", tool_error=True)
    assert env.timeout_observation() == "<out>timeout</out>"


def test_stateless_by_default():
    env = _env()
    env.step("<py>x = 6</py>")
    step = env.step("<py>print(x)</py>")
    assert step.info["tool_error"] and step.observation == "<out>NameError: name 'x' is not defined</out>"


def test_stateful_replays_earlier_successful_calls():
    env = _env(stateful=True)
    assert env.step("<py>x = 6\nprint('set')</py>") == _call("<out>set\n</out>")
    assert env.step("<py>def f(y):\n    return x * y</py>") == _call("<out></out>")
    assert env.step("<py>x = 100; 1/0</py>").info["tool_error"]  # failed: not replayed, x stays 6
    assert env.step("<py>print(f(7))</py>") == _call("<out>42\n</out>")  # only the new call's output
    assert env.history == ["x = 6\nprint('set')", "def f(y):\n    return x * y", "print(f(7))"]
    env.reset(Prompt("p1", "again", "1"))
    assert env.step("<py>print(x)</py>").info["tool_error"]  # a new episode starts empty


def test_replay_program_compiles_each_call_alone():
    """Each call is compiled on its own, so a ``__future__`` import in any call stays legal."""
    assert replay_program([], "print(1)") == "print(1)"
    env = _env(stateful=True)
    assert env.step("<py>from __future__ import annotations\ndef g(a: Undefined): return 1</py>").info == {
        "tool_call": True}
    assert env.step("<py>from __future__ import annotations\nprint(g(0))</py>") == _call("<out>1\n</out>")


@pytest.mark.parametrize("answer, text, right", [
    ("42", " 42 ", True), ("42", "42.0", True), ("42", "41", False), ("1/2", "0.5", True),
    ("paris", "paris", True), ("paris", "london", False),
])  # fmt: skip
def test_final_answer(answer, text, right):
    step = _env(answer).step(text)
    assert (step.observation, step.reward, step.done, step.info) == (None, float(right), True, {"correct": right})


def test_malformed_calls():
    env = _env()
    assert env.step("<py>print(1)") == EnvStep("<out>error: unclosed call</out>", info={"malformed": True})
    assert env.history == []


def test_hermes_format():
    env = _env(call_format="hermes")
    assert env.stop == ["</tool_call>"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    assert env.step(call) == _call("<out>42\n</out>")
    for bad in ('{"name": "calculator", "arguments": {"code": "1"}}', '{"name": "python", "arguments": {"code": 1}}',
                '{"name": "python", "arguments": {}}', "{oops}"):
        assert env.step(f"<tool_call>{bad}</tool_call>").info == {"malformed": True}


def test_bad_parameters():
    with pytest.raises(ValueError, match="unknown call_format"):
        PythonTool(call_format="xml")
    with pytest.raises(ValueError, match="timeout_s"):
        PythonTool(timeout_s=0)
