"""``python_tool``: the policy calls a Python interpreter, then answers.

An episode: each model turn is either a call, ``<py>print(6*7)</py>`` (or the hermes JSON format
with tool ``python`` and argument ``code``, see ``tool_calls.py``), answered with what the program
printed (``<out>42\n</out>``), or the final answer, which ends the episode with reward 1 if it
equals the task's answer (as numbers when both parse as numbers, else as stripped strings).

The code never runs in this process: every call is a fresh program in tidal's sandbox
(``rewards/sandbox.py``, docs/sandbox.md) under ``timeout_s`` of wall clock. A program that raises,
times out or hits a limit is a tool error the policy sees (the error's last line, e.g.
``<out>ZeroDivisionError: division by zero</out>``); it never stops the run. A sandbox that cannot
be built (``SandboxUnavailable``, ``SandboxError``) is the environment's failure, not the policy's:
it propagates, and the episode ends as an infrastructure failure.

``stateful=True`` keeps variables across an episode's calls by replay: each call's program first
re-runs the code of the episode's earlier successful calls, with their output discarded, then the
new code. Simple and exact for deterministic code, at a cost: the n-th call runs all n programs
(quadratic in calls per episode), within the one call's ``timeout_s``; code with side effects or
randomness runs again (a replayed call that now fails makes the new call fail with its error).
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.envs.calculator import same_number
from tidal.envs.tool_calls import Answer, CallFormat, Malformed
from tidal.rewards.sandbox import RunResult, SandboxLimits, run_python
from tidal.types import Prompt

TOOL, ARGUMENT = "python", "code"


def python_call_format(kind: str) -> CallFormat:
    """``tagged``: ``<py>CODE</py>``; ``hermes``: JSON calls to the tool ``python`` with argument ``code``."""
    if kind == "tagged":
        return CallFormat(kind="tagged", open="<py>", close="</py>", tool=TOOL, argument=ARGUMENT)
    if kind == "hermes":
        return CallFormat.hermes(TOOL, ARGUMENT)
    raise ValueError(f"unknown call_format {kind!r}: use 'tagged' or 'hermes'")


def replay_program(history: Sequence[str], code: str) -> str:
    """One program that runs ``history`` (earlier calls' code) with stdout discarded, then ``code``;
    each in the program's one global namespace, so the earlier calls' variables persist."""
    if not history:
        return code
    replays = "".join(f"exec(compile({past!r}, '<call {i}>', 'exec'))\n" for i, past in enumerate(history))
    return (
        "import os as _tidal_os, sys as _tidal_sys\n"
        "_tidal_sys.stdout = open(_tidal_os.devnull, 'w')\n"
        f"{replays}"
        "_tidal_sys.stdout = _tidal_sys.__stdout__\n"
        f"exec(compile({code!r}, '<call {len(history)}>', 'exec'))\n"
    )


def error_line(result: RunResult, timeout_s: float) -> str:
    """Why a run failed, in one line: the last line of stderr for a program that raised (the
    exception), ``timeout after {timeout_s}s`` (not the measured time: the same call must get the same
    observation), else the sandbox's reason (an output or memory limit, a signal, a bare exit code)."""
    if result.timed_out:
        return f"timeout after {timeout_s:g}s"
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    if result.exit_code and not result.output_exceeded and lines:
        return lines[-1]
    return result.reason()


@ENVS.register("python_tool")
class PythonTool:
    """See the module docstring. ``call_format``: ``tagged`` or ``hermes``; ``result_open``/
    ``result_close`` wrap an observation; ``max_output_chars`` truncates what a call printed (or its
    error line); ``timeout_s``: wall-clock seconds per call (keep it under ``env.step_timeout_s``);
    ``allow_unisolated``: run with rlimits only where namespaces are unavailable (docs/sandbox.md)."""

    def __init__(self, call_format: str = "tagged", result_open: str = "<out>", result_close: str = "</out>",
                 max_output_chars: int = 200, timeout_s: float = 5.0, stateful: bool = False,
                 allow_unisolated: bool = False):
        if timeout_s <= 0 or max_output_chars < 0:
            raise ValueError("python_tool: need timeout_s > 0 and max_output_chars >= 0")
        self.format = python_call_format(call_format)
        self.result_open, self.result_close = result_open, result_close
        self.max_output_chars = max_output_chars
        self.limits = SandboxLimits(timeout_s=timeout_s, allow_unisolated=allow_unisolated)
        self.stateful = stateful
        self.stop = [self.format.close]
        self.answer = ""
        self.history: list[str] = []  # code of this episode's successful calls (stateful replay)

    def reset(self, prompt: Prompt) -> str | None:
        self.answer = prompt.answer
        self.history = []
        return None

    def observe(self, text: str) -> str:
        return f"{self.result_open}{text[: self.max_output_chars]}{self.result_close}"

    def timeout_observation(self) -> str:
        return self.observe("timeout")

    def step(self, turn_text: str) -> EnvStep:
        parsed = self.format.parse(turn_text)
        if isinstance(parsed, Answer):
            correct = same_number(parsed.text, self.answer)
            return EnvStep(None, float(correct), done=True, info={"correct": correct})
        if isinstance(parsed, Malformed):
            return EnvStep(self.observe(f"error: {parsed.reason}"), info={"malformed": True})
        code = parsed.arguments.get(ARGUMENT)
        if parsed.name != TOOL or not isinstance(code, str):
            return EnvStep(self.observe(f"error: call {TOOL} with a string {ARGUMENT!r}"), info={"malformed": True})
        return self.run(code)

    def run(self, code: str) -> EnvStep:
        """Run one call's code in the sandbox (after the replay of earlier calls when stateful)."""
        history = self.history if self.stateful else []
        result = run_python(replay_program(history, code), limits=self.limits)
        if not result.ok:
            error = error_line(result, self.limits.timeout_s)
            return EnvStep(self.observe(error), info={"tool_call": True, "tool_error": True})
        if self.stateful:
            self.history.append(code)
        return EnvStep(self.observe(result.stdout), info={"tool_call": True})

