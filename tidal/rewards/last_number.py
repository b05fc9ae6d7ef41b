"""``last_number``: the last number of a prose answer, compared numerically with ``prompt.answer``.

For chat models that answer in sentences ("37 + 48 = 85", "The total is $1,234.50.") rather than in
``\\boxed{}``: the answer region (after the last ``</think>``, verbatim copies of the question removed)
is read for numbers (signs, thousands commas, decimals, ``a/b``; a sentence's final period is not a
decimal point; the reading rules are ``rewards/prose.py``) and the last one is the answer. Equal to
the gold as a number (``35.0`` = ``35`` = ``035``) scores 1. The gold must itself be one number.

"The last number" is what a model can game cheaply, so each of these scores 0, with the reason:
- ``restates the question``: the last number is an operand of an expression (``22+13 is 22+13.``,
  ``35? 22+13``, ``22 plus 13``, ``(22)+(13)``): the response ends in arithmetic, not a value (the
  rule of ``rewards/restate.py``, read from the text); ``not a value: arithmetic left to do`` when the
  expression uses none of the question's numbers (``35 * 1``), or is a quotient that divides out
  (``70/2``);
- ``hedging``: the final statement (the sentence or line holding the last number, with any bare-number
  lines or sentences just before it: a list) states more than ``max_candidates`` distinct values.
  A value is a number that is no operand in that statement and not a number of the question, so
  "33 34 35 36", "33, 34 or 35" and "33\\n34\\n35" hedge while "22 + 13 = 35" and "20 + 10 = 30, so
  30 + 5 = 35" state one value (30 is used again as an operand). Listing the question's numbers is not
  hedging: ``22 13`` ends in 13, a wrong answer;
- ``answer too long``: an answer region over ``max_chars`` (a gold buried in filler);
- ``empty answer``, ``no number in the answer`` (``\\boxed{}``, ``<answer></answer>``), and an unclosed
  ``<think>`` (``after_think``), as in ``math``.

Not caught: a change of mind in separate sentences ("It is 33. No, 35.") counts the last statement,
as a reader would; questions whose answer is one of their own numbers ("Which is larger, 35 or 22?")
need a choice-aware reward, since answering with the question's numbers is then not hedging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.rewards.math import answer_region, strip_question
from tidal.rewards.prose import parse_number, read_final
from tidal.types import Prompt


@dataclass
class LastNumberReward:
    """``last_number``: 1.0 when the answer's last number equals ``prompt.answer``; see the module docstring."""

    after_think: bool = True
    """Read only the text after the last ``</think>``; an unclosed ``<think>`` has no answer (as ``math``)."""
    strip_question: bool = True
    """Remove verbatim copies of the question (whitespace-insensitive, multi-word questions) first, so an
    echoed question's numbers are neither the answer nor candidates."""
    max_chars: int = 4000
    """An answer region longer than this scores 0 (``answer too long``): a gold buried in filler. A
    prose answer to a school math problem is a few hundred characters; raise it for long chains of
    thought without ``<think>`` tags."""
    max_candidates: int = 1
    """The most distinct values the final statement may state (more: ``hedging``)."""
    rel_tol: float = 0.0
    """Relative tolerance of the comparison (0: exact; decimals are compared as exact fractions, so
    ``0.30`` = ``0.3``). E.g. 1e-4 for answers rounded to 4 significant digits."""
    reject_restated: bool = True
    """Score 0 when the last number is an operand of an expression or an a/b that divides out."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_chars, int) and self.max_chars > 0):
            raise ConfigError(f"last_number: max_chars must be a positive integer, got {self.max_chars!r}")
        if not (isinstance(self.max_candidates, int) and self.max_candidates >= 1):
            raise ConfigError(f"last_number: max_candidates must be an integer >= 1, got {self.max_candidates!r}")
        if not (isinstance(self.rel_tol, (int, float)) and 0 <= self.rel_tol < 1):
            raise ConfigError(f"last_number: rel_tol must be in [0, 1), got {self.rel_tol!r}")

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        gold = parse_number(prompt.answer)
        if gold is None:
            why = f"gold answer is not one number: {prompt.answer!r}"
            return 0.0, {"error": why, "reason": "gold not a number"}
        details: dict[str, Any] = {"extracted": None, "gold": prompt.answer.strip()}

        def result(reason: str, correct: bool = False) -> tuple[float, dict[str, Any]]:
            return float(correct), {**details, "correct": correct, "reason": reason}

        region = answer_region(response, self.after_think)
        if region is None:
            return result("unfinished thinking: no </think>, so no final answer")
        if self.strip_question:
            region = strip_question(region, prompt.text)
        region = region.replace("−", "-").strip()
        if not region:
            return result("empty answer")
        if len(region) > self.max_chars:
            return result(f"answer too long ({len(region)} chars > max_chars {self.max_chars})")
        final = read_final(region, prompt.text)
        if final is None:
            return result("no number in the answer")
        last = final.last
        details["extracted"] = last.text
        if self.reject_restated and final.restated:
            return result(final.restated)
        if len(final.values) > self.max_candidates:
            details["candidates"] = [str(c) for c in final.values]
            return result(f"hedging: {len(final.values)} values in the final statement")
        correct = last.value == gold or (self.rel_tol > 0 and abs(last.value - gold) <= self.rel_tol * abs(gold))
        return result("correct" if correct else "wrong answer", correct)


REWARDS.register("last_number")(LastNumberReward)
