"""``last_number``: the last number of a prose answer, compared numerically with ``prompt.answer``.

For chat models that answer in sentences ("37 + 48 = 85", "The total is $1,234.50.") rather than in
``\\boxed{}``: the answer region (after the last ``</think>``, verbatim copies of the question removed)
is read for numbers (signs, thousands commas, decimals, ``a/b``; a sentence's final period is not a
decimal point) and the last one is the answer. Equal to the gold as a number (``35.0`` = ``35`` =
``035``) scores 1. The gold must itself be one number.

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

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.rewards.math import strip_question
from tidal.rewards.restate import RESTATED, UNEVALUATED
from tidal.types import Prompt

# A number: thousands groups (1,234,567) or plain digits, a decimal part, an optional /denominator. The
# sign is attached only when it cannot be a binary minus (see ``numbers``).
_NUMBER = re.compile(r"(?<![\w.])(-?)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?(?:/(\d+)(?![\d.]))?")
_OPERATOR = r"(?:[+\-*/×·÷^]|\\times|\\cdot|\\div|\bplus|\bminus|\btimes|\bdivided by|\bmultiplied by|\bover)"
# An operator between the number and another number (parentheses around either are transparent).
_OPERAND_BEFORE = re.compile(r"(?:\d|\))\s*\)*\s*" + _OPERATOR + r"\s*\(*\s*$", re.I)
_OPERAND_AFTER = re.compile(r"^\s*\)*\s*" + _OPERATOR + r"\s*\(*\s*-?\d", re.I)
# A statement ends at a line break or at . ! ? ; followed by a space or the end (3.5 does not end one).
_STATEMENT_END = re.compile(r"\n|[.!?;](?=\s|$)")
_BARE = re.compile(r"(?:[\s,.;:!?()\[\]*\-]|\bor\b|\band\b)*", re.I)


@dataclass(frozen=True)
class Number:
    """One number in the answer: where it is, its text and its exact value."""

    start: int
    end: int
    text: str
    value: Fraction
    divides_out: bool  # an a/b that is an integer (70/2): a division left to do


def numbers(text: str) -> list[Number]:
    """Every number in ``text``, in order. ``-`` is a sign unless a number or a closing bracket comes
    before it (``22 - 13`` has 22 and 13; ``is -4`` has -4); ``1,234`` is one number, ``1, 2`` two."""
    text = text.replace("−", "-")  # U+2212, the typeset minus
    out = []
    for m in _NUMBER.finditer(text):
        sign, start = m.group(1), m.start()
        before = text[:start].rstrip()
        if sign and before and (before[-1].isdigit() or before[-1] in ")]"):
            sign, start = "", start + 1  # a binary minus: 22-13
        whole = Fraction(m.group(2).replace(",", "") + (m.group(3) or ""))
        q = m.group(4)
        value = whole / int(q) if q and int(q) != 0 else whole
        divides_out = bool(q) and int(q) != 0 and whole.denominator == 1 and whole.numerator % int(q) == 0
        out.append(Number(start, m.end(), text[start : m.end()], -value if sign else value, divides_out))
    return out


def is_operand(text: str, n: Number) -> bool:
    """Whether number ``n`` is an operand of an arithmetic expression in ``text`` (``22+13``, ``22 plus
    13``, ``(22)+(13)``); ``=`` is not an operator, so the result in ``37 + 48 = 85`` is a value."""
    text = text.replace("−", "-")
    return bool(_OPERAND_BEFORE.search(text[max(0, n.start - 40) : n.start])
                or _OPERAND_AFTER.match(text[n.end : n.end + 40]))


def parse_gold(gold: str) -> Fraction | None:
    """The gold answer as one number (``052``, ``-5``, ``1,234``, ``3.50``, ``1/2``; a final period and
    ``$`` are ignored); None when it is not exactly one number."""
    s = gold.strip().strip("$").rstrip(".").strip().replace("−", "-")
    found = numbers(s)
    return found[0].value if len(found) == 1 and found[0].text == s else None


def final_statement(text: str, last: Number) -> tuple[int, int]:
    """``(start, end)`` of the statement holding ``last``, extended back over bare-number statements
    just before it (a list written one candidate per line or sentence)."""
    ends = [m.end() for m in _STATEMENT_END.finditer(text)]
    start = max((e for e in ends if e <= last.start), default=0)
    end = min((e for e in ends if e > last.start), default=len(text))
    while start > 0:
        prev = max((e for e in ends if e < start), default=0)
        chunk = text[prev:start]
        if not numbers(chunk) or _BARE.fullmatch(_NUMBER.sub("", chunk)) is None:
            break
        start = prev
    return start, end


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
        gold = parse_gold(prompt.answer)
        if gold is None:
            why = f"gold answer is not one number: {prompt.answer!r}"
            return 0.0, {"error": why, "reason": "gold not a number"}
        details: dict[str, Any] = {"extracted": None, "gold": prompt.answer.strip()}

        def result(reason: str, correct: bool = False) -> tuple[float, dict[str, Any]]:
            return float(correct), {**details, "correct": correct, "reason": reason}

        region = response
        if self.after_think and ("<think>" in response or "</think>" in response):
            if "</think>" not in response:
                return result("unfinished thinking: no </think>, so no final answer")
            region = response.rsplit("</think>", 1)[1]
        if self.strip_question:
            region = strip_question(region, prompt.text)
        region = region.replace("−", "-").strip()
        if not region:
            return result("empty answer")
        if len(region) > self.max_chars:
            return result(f"answer too long ({len(region)} chars > max_chars {self.max_chars})")
        found = numbers(region)
        if not found:
            return result("no number in the answer")
        last = found[-1]
        details["extracted"] = last.text
        asked = {abs(Fraction(n.value)) for n in numbers(prompt.text)}
        start, end = final_statement(region, last)
        statement = [n for n in found if start <= n.start < end]
        operand = {n.start: is_operand(region, n) for n in statement}
        if self.reject_restated and (operand[last.start] or last.divides_out):
            used = {abs(n.value) for n in statement if operand[n.start] or n is last}
            return result(RESTATED if used & asked else UNEVALUATED)
        operands = {n.value for n in statement if operand[n.start]}  # a value used again is a step, not a candidate
        candidates = sorted({n.value for n in statement if n.value not in operands and abs(n.value) not in asked}
                            | {last.value})
        if len(candidates) > self.max_candidates:
            details["candidates"] = [str(c) for c in candidates]
            return result(f"hedging: {len(candidates)} values in the final statement")
        correct = last.value == gold or (self.rel_tol > 0 and abs(last.value - gold) <= self.rel_tol * abs(gold))
        return result("correct" if correct else "wrong answer", correct)


REWARDS.register("last_number")(LastNumberReward)
