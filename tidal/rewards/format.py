"""Format reward: does the response have the structure the task asks for? 1.0 if every configured
check passes, else 0.0, with the first failing check's reason in ``details["reason"]``.

Magistral (arXiv 2506.10910, sec. 2.2, "formatting") requires, before a response is graded at
all: (i) the response starts with ``<think>`` and has exactly one ``<think>``/``</think>`` pair;
(ii) for math, a ``\\boxed{}`` final answer in the answer section after ``</think>``; (iii) for code,
at least one markdown code block fenced with triple backticks followed by the language name. A
response that fails gets 0 and is not graded further (use this reward as a gate in ``compose``);
one that passes gets +0.1 (the weight you give this term in ``compose``).

Checks (``checks`` picks any subset, in this order):
- ``think``: starts with ``<think>`` (after whitespace), exactly one ``<think>`` and one
  ``</think>`` in that order, non-empty thoughts, and a non-empty answer after ``</think>``;
- ``boxed``: the answer section (after ``</think>`` if present, else the whole response) has a
  ``\\boxed{..}`` with non-empty content;
- ``code``: the answer section has a fenced code block (with a language name after the opening
  backticks when ``code_lang``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.rewards.math import boxed_contents
from tidal.types import Prompt

CHECKS = ("think", "boxed", "code")

# A fence at a line start: ```lang, the body, a closing ``` at a line start.
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n.*?^[ \t]*```", re.S | re.M)


def check_think(response: str) -> str | None:
    """None when the think structure is right, else the reason it is not."""
    if not response.lstrip().startswith("<think>"):
        return "does not start with <think>"
    num_open, num_close = response.count("<think>"), response.count("</think>")
    if num_open != 1 or num_close != 1:
        return f"needs exactly one <think> and one </think> (got {num_open} and {num_close})"
    thoughts, sep, answer = response.partition("<think>")[2].partition("</think>")
    if not sep:
        return "</think> before <think>"
    if not thoughts.strip():
        return "empty thoughts"
    if not answer.strip():
        return "empty answer after </think>"
    return None


def answer_section(response: str) -> str:
    """The text after the last ``</think>``, or the whole response when it has none."""
    return response.rsplit("</think>", 1)[1] if "</think>" in response else response


def check_boxed(response: str) -> str | None:
    if not any(b.strip() for b in boxed_contents(answer_section(response))):
        return "no non-empty \\boxed{} in the answer"
    return None


def check_code(response: str, code_lang: bool = True) -> str | None:
    langs = [m.group(1) for m in _FENCE.finditer(answer_section(response))]
    if not langs:
        return "no fenced code block in the answer"
    if code_lang and not any(langs):
        return "code block without a language name after ```"
    return None


@dataclass
class FormatReward:
    """``format``: 1.0 when every check in ``checks`` passes, else 0.0 (see the module docstring)."""

    checks: list[str] = field(default_factory=lambda: ["think", "boxed"])
    """Which checks to run: ``think``, ``boxed`` (math), ``code`` (code). Default: Magistral's math format."""
    code_lang: bool = True
    """``code`` requires a language name after the opening backticks (Magistral sec. 2.2)."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks:
            raise ConfigError(f"format: checks must be a non-empty subset of {CHECKS}, got {self.checks!r}")

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        passed: dict[str, bool] = {}
        reason = None
        for check in CHECKS:
            if check not in self.checks:
                continue
            if check == "think":
                why = check_think(response)
            elif check == "boxed":
                why = check_boxed(response)
            else:
                why = check_code(response, self.code_lang)
            passed[check] = why is None
            reason = reason or why
        return float(reason is None), {"passed": passed, "reason": reason or "ok"}


REWARDS.register("format")(FormatReward)
