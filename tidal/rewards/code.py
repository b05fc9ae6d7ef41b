"""Code reward: run the program in a response against the prompt's tests, in the sandbox.

The program is taken from the response (``extract``): by default the last fenced ```python block,
else the last fenced block of any language, else the whole response (an unclosed fence, as in a
truncated response, counts from the fence to the end). It is then run by ``sandbox.run_python``
against ``prompt.meta["tests"]`` (a dict, or the same as a JSON string), in one of two formats:

- ``{"kind": "io", "cases": [{"input": str, "output": str}, ...]}``: one run per case with the
  input on stdin; a case passes when the run exits 0 and its stdout equals the expected output
  after stripping trailing whitespace from every line and dropping trailing blank lines.
- ``{"kind": "assert", "code": str, "entry_point": str, "prompt": str (optional)}``: HumanEval's
  format (Chen et al. 2021). The program is ``prompt + completion`` (if the completion does not
  itself define ``entry_point`` at top level; if it does, only the prompt's top-level import lines
  are put in front, since models often drop ``from typing import List``), then the test ``code``,
  then ``check(entry_point)``, then a line printing a random marker. It is one case: it passes
  when the run exits 0 *and* printed the marker last, so that a program calling ``exit(0)`` (or
  ``os._exit(0)``) before the tests ran does not pass. The tests share an interpreter with the
  program, so a deliberately adversarial one can still defeat them (e.g. by returning an object
  whose ``__eq__`` is always True); see docs/sandbox.md.

The reward is ``passed / total`` (``mode="fraction"``) or 1.0 only if every case passes
(``mode="all_pass"``, the default: a binary, unhackable-by-partial-credit signal as in the GRPO
code recipes; all-pass also stops at the first failing case). ``details`` has ``passed``,
``total``, ``reason`` (why the first failing case failed) and ``cases`` (per case: ``passed``,
``reason``, and on a wrong answer the ``got``/``expected`` outputs, truncated).

Budgets compose with the reward pool's per-response limit (``RewardConfig.timeout_s``, 10 s by
default): each program may run ``timeout_s``; the cases of one response together get
``total_timeout_s`` (8 s by default, under the pool's 10 s so that the reward returns its own
partial result instead of being killed; cases it did not reach fail with "time budget exhausted").
A response whose tests are missing or malformed raises ValueError naming the field: the pool turns
that into reward 0 with the message in ``details["error"]``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.rewards.sandbox import SandboxLimits, run_python
from tidal.types import Prompt

_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_MAX_CASE_DETAILS = 20  # details are logged per response: keep them small
_MAX_SHOWN_CHARS = 200


def extract_code(response: str, how: str = "auto") -> str | None:
    """The program in ``response``, or None when ``how`` demands a fence that is not there.

    ``how``: "auto" (python fence, else any fence, else the raw response), "python" (a python
    fence only), "fenced" (any fence), "raw" (the whole response).
    """
    if how == "raw":
        return response
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1]
    if how == "python":
        return None
    if blocks:
        return blocks[-1][1]
    return response if how == "auto" else None


def normalize_output(text: str) -> str:
    """Trailing whitespace of every line and trailing blank lines do not count."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _field(obj: dict, key: str, where: str, kind: type = str) -> Any:
    if not isinstance(obj.get(key), kind):
        got = "missing" if key not in obj else type(obj[key]).__name__
        raise ValueError(f"code reward: {where}[{key!r}] must be a {kind.__name__} (got {got})")
    return obj[key]


def parse_tests(tests: Any) -> dict:
    """Validate ``prompt.meta["tests"]``; raise ValueError naming the offending field."""
    where = 'prompt.meta["tests"]'
    if tests is None:
        raise ValueError(
            f'code reward: {where} is missing; expected {{"kind": "io", "cases": [{{"input", "output"}}]}} '
            'or {"kind": "assert", "code", "entry_point", "prompt"}'
        )
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"code reward: {where} is a string but not JSON: {e}") from None
    if not isinstance(tests, dict):
        raise ValueError(f"code reward: {where} must be a dict, got {type(tests).__name__}")
    kind = tests.get("kind")
    if kind == "io":
        cases = _field(tests, "cases", where, list)
        if not cases:
            raise ValueError(f"code reward: {where}['cases'] is empty")
        for i, case in enumerate(cases):
            if not isinstance(case, dict):
                raise ValueError(f"code reward: {where}['cases'][{i}] must be a dict")
            _field(case, "input", f"{where}['cases'][{i}]")
            _field(case, "output", f"{where}['cases'][{i}]")
    elif kind == "assert":
        _field(tests, "code", where)
        if not _field(tests, "entry_point", where).isidentifier():
            raise ValueError(f"code reward: {where}['entry_point'] must be a Python identifier")
        if "prompt" in tests:
            _field(tests, "prompt", where)
    else:
        raise ValueError(f"code reward: {where}['kind'] must be 'io' or 'assert' (got {kind!r})")
    return tests


def assemble_assert_program(completion: str, tests: dict, marker: str = "") -> str:
    """HumanEval's program: prompt (or its imports) + completion + test code + ``check(entry_point)``,
    then ``print(marker)`` when a marker is given (see ``CodeReward``: an early exit(0) must not pass)."""
    entry, prefix = tests["entry_point"], tests.get("prompt", "")
    if re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(", completion, re.MULTILINE):
        imports = [line for line in prefix.splitlines() if re.match(r"(?:import|from)\s", line)]
        head = "\n".join(imports) + "\n" if imports else ""
    else:
        head = prefix
    tail = f"print({marker!r})\n" if marker else ""
    return f"{head}{completion}\n\n{tests['code']}\n\ncheck({entry})\n{tail}"


def _shorten(text: str) -> str:
    extra = len(text) - _MAX_SHOWN_CHARS
    return text if extra <= 0 else f"{text[:_MAX_SHOWN_CHARS]}...({extra} more chars)"


def _syntax_error(program: str) -> str | None:
    """Checked once here rather than failing every case in the sandbox (compiling runs no code)."""
    try:
        compile(program, "main.py", "exec")
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return f"cannot compile: {type(e).__name__}: {e}"
    return None


@REWARDS.register("code")
@dataclass
class CodeReward:
    """Pass rate of the response's program on ``prompt.meta["tests"]``; see the module docstring."""

    mode: str = "all_pass"
    """"all_pass": 1.0 iff every case passes (stops at the first failure); "fraction": passed / total."""
    extract: str = "auto"
    """Where the program is: "auto" | "python" | "fenced" | "raw" (see ``extract_code``)."""
    timeout_s: float = 3.0
    """Wall-clock limit per program run (one io case, or the whole assert program)."""
    total_timeout_s: float = 8.0
    """All runs of one response; keep it under the pool's ``RewardConfig.timeout_s`` (10 s)."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS)."""
    max_processes: int = 8
    """Processes and threads per run (RLIMIT_NPROC)."""
    max_output_kb: int = 1024
    """Captured stdout/stderr per run; more and the run is killed and fails."""
    site_packages: bool = False
    """Let programs import installed packages (numpy, ...); stdlib only by default."""
    allow_unisolated: bool = False
    """Run with rlimits only where namespaces are unavailable (docs/sandbox.md); off: such a run fails."""

    def __post_init__(self) -> None:
        if self.mode not in ("all_pass", "fraction"):
            raise ConfigError(f"reward 'code': mode must be 'all_pass' or 'fraction', got {self.mode!r}")
        if self.extract not in ("auto", "python", "fenced", "raw"):
            raise ConfigError(f"reward 'code': extract must be auto|python|fenced|raw, got {self.extract!r}")
        if not 0 < self.timeout_s <= self.total_timeout_s:
            raise ConfigError("reward 'code': need 0 < timeout_s <= total_timeout_s")

    def limits(self, timeout_s: float) -> SandboxLimits:
        return SandboxLimits(
            timeout_s=timeout_s, memory_mb=self.memory_mb, max_processes=self.max_processes,
            max_output_bytes=self.max_output_kb * 1024, site_packages=self.site_packages,
            allow_unisolated=self.allow_unisolated,
        )  # fmt: skip

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        tests = parse_tests(prompt.meta.get("tests"))
        total = len(tests["cases"]) if tests["kind"] == "io" else 1
        code = extract_code(response, self.extract)
        if code is None:
            return 0.0, {"passed": 0, "total": total, "reason": f"no code block (extract={self.extract!r})"}
        if tests["kind"] == "io":
            runs = [(code, case["input"], case["output"], "") for case in tests["cases"]]
        else:
            marker = f"tidal-tests-passed-{os.urandom(8).hex()}"
            runs = [(assemble_assert_program(code, tests, marker), "", None, marker)]
        bad_syntax = _syntax_error(runs[0][0])
        if bad_syntax:
            return 0.0, {"passed": 0, "total": total, "reason": bad_syntax}
        cases = self._run_cases(runs)
        passed = sum(c["passed"] for c in cases)
        details: dict[str, Any] = {"passed": passed, "total": total}
        failed = [c["reason"] for c in cases if not c["passed"]]
        if failed:
            details["reason"] = failed[0]
        details["cases"] = cases[:_MAX_CASE_DETAILS]
        score = passed / total if self.mode == "fraction" else float(passed == total)
        return score, details

    def _run_cases(self, runs: list[tuple[str, str, str | None, str]]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.total_timeout_s
        cases: list[dict[str, Any]] = []
        for program, stdin, expected, marker in runs:
            left = deadline - time.monotonic()
            if left < 0.1 or (self.mode == "all_pass" and cases and not cases[-1]["passed"]):
                reason = "time budget exhausted" if left < 0.1 else "not run (all_pass: an earlier case failed)"
                cases.append({"passed": False, "reason": reason})
                continue
            result = run_python(program, stdin, self.limits(min(self.timeout_s, left)))
            if not result.ok:
                cases.append({"passed": False, "reason": result.reason()})
            elif marker and not normalize_output(result.stdout).endswith(marker):
                cases.append({"passed": False, "reason": "exited before the tests finished"})
            elif expected is not None and normalize_output(result.stdout) != normalize_output(expected):
                got, want = _shorten(result.stdout), _shorten(expected)
                cases.append({"passed": False, "reason": "wrong answer", "got": got, "expected": want})
            else:
                cases.append({"passed": True, "reason": ""})
        return cases
