"""Reading numbers out of prose answers: the text rules ``last_number`` scores by and ``math``'s lenient
mode checks hedging with.

A number is an integer (``1,234`` with thousands groups, ``052``), a decimal (``3.50``; a sentence's
final period is not a decimal point), a fraction ``a/b`` or ``\\frac{a}{b}``, with a sign where ``-``
cannot be a binary minus. Three readings on top of that:

- an *operand* is a number next to an arithmetic operator whose other side is a number too (``22+13``,
  ``22 plus 13``, ``(22)+(13)``); ``=`` is no operator, so in ``37 + 48 = 85`` 85 is a value;
- the *final statement* is the sentence or line holding the last number, extended back over bare-number
  lines or sentences just before it (a list of candidates written one per line);
- its *stated values* are its numbers that are no operand there and not a number of the question:
  "33 34 35" states three, "22 + 13 = 35" one, "20 + 10 = 30, so 30 + 5 = 35" one (30 is used again).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from fractions import Fraction

from tidal.rewards.restate import RESTATED, UNEVALUATED

# \frac{a}{b}, or: thousands groups (1,234,567) or plain digits, a decimal part, an optional /denominator.
_NUMBER = re.compile(r"\\[dt]?frac\s*\{\s*(?P<fsign>-?)(?P<fnum>\d+)\s*\}\s*\{\s*(?P<fden>\d+)\s*\}"
                     r"|(?<![\w.])(?P<sign>-?)(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<dec>\.\d+)?"
                     r"(?:/(?P<den>\d+)(?![\d.]))?")
_OPERATOR = r"(?:[+\-*/×·÷^]|\\times|\\cdot|\\div|\bplus|\bminus|\btimes|\bdivided by|\bmultiplied by|\bover)"
# An operator between the number and another number (parentheses around either are transparent).
_OPERAND_BEFORE = re.compile(r"(?:\d|\))\s*\)*\s*" + _OPERATOR + r"\s*\(*\s*$", re.I)
_OPERAND_AFTER = re.compile(r"^\s*\)*\s*" + _OPERATOR + r"\s*\(*\s*-?\d", re.I)
# A statement ends at a line break or at . ! ? ; followed by a space or the end (3.5 does not end one).
_STATEMENT_END = re.compile(r"\n|[.!?;](?=\s|$)")
_BARE = re.compile(r"(?:[\s,.;:!?()\[\]*\-]|\bor\b|\band\b)*", re.I)


@dataclass(frozen=True)
class Number:
    """One number in a text: where it is, its text and its exact value."""

    start: int
    end: int
    text: str
    value: Fraction
    divides_out: bool
    """An a/b that is an integer (``70/2``, ``\\frac{70}{2}``): a division left to do, not a value."""


def numbers(text: str) -> list[Number]:
    """Every number in ``text``, in order. ``-`` is a sign unless a number or a closing bracket comes
    before it (``22 - 13`` has 22 and 13; ``is -4`` has -4); ``1,234`` is one number, ``1, 2`` two."""
    text = text.replace("−", "-")  # U+2212, the typeset minus (one character for one: offsets hold)
    out = []
    for m in _NUMBER.finditer(text):
        start = m.start()
        if m.group("fnum") is not None:
            sign, whole, q = m.group("fsign"), Fraction(m.group("fnum")), m.group("fden")
        else:
            sign, whole, q = m.group("sign"), Fraction(m.group("int").replace(",", "") + (m.group("dec") or "")), \
                m.group("den")
            before = text[:start].rstrip()
            if sign and before and (before[-1].isdigit() or before[-1] in ")]"):
                sign, start = "", start + 1  # a binary minus: 22-13
        value = whole / int(q) if q and int(q) != 0 else whole
        divides_out = bool(q) and int(q) != 0 and whole.denominator == 1 and whole.numerator % int(q) == 0
        out.append(Number(start, m.end(), text[start : m.end()], -value if sign else value, divides_out))
    return out


def parse_number(text: str) -> Fraction | None:
    """``text`` as exactly one number (``052``, ``-5``, ``1,234``, ``3.50``, ``1/2``, ``\\frac{1}{2}``; a
    final period and ``$`` are ignored); None otherwise."""
    s = text.strip().strip("$").rstrip(".").strip().replace("−", "-")
    found = numbers(s)
    return found[0].value if len(found) == 1 and found[0].text == s else None


def is_operand(text: str, n: Number) -> bool:
    """Whether number ``n`` is an operand of an arithmetic expression in ``text`` (see the module docstring)."""
    text = text.replace("−", "-")
    return bool(_OPERAND_BEFORE.search(text[max(0, n.start - 40) : n.start])
                or _OPERAND_AFTER.match(text[n.end : n.end + 40]))


def final_statement(text: str, last: Number) -> tuple[int, int]:
    """``(start, end)`` of the statement holding ``last`` (see the module docstring)."""
    ends = [m.end() for m in _STATEMENT_END.finditer(text)]  # sorted: bisect keeps a hostile list linear
    i = bisect.bisect_right(ends, last.start)  # statements before the last number's: ends[:i]
    start, end = (ends[i - 1] if i else 0), (ends[i] if i < len(ends) else len(text))
    while i > 0:
        prev = ends[i - 2] if i > 1 else 0
        chunk = text[prev:start]
        if chunk.strip() and (not numbers(chunk) or _BARE.fullmatch(_NUMBER.sub("", chunk)) is None):
            break  # a statement with words in it (a blank one, "33.\n" ending twice, is skipped)
        start, i = prev, i - 1
    return start, end


@dataclass(frozen=True)
class FinalAnswer:
    """What the end of a prose answer says."""

    last: Number
    """The last number."""
    restated: str | None
    """``restate.RESTATED`` / ``UNEVALUATED`` when the last number is an operand or an a/b that divides
    out (the answer ends in arithmetic, not a value); None otherwise."""
    values: list[Fraction]
    """The distinct values the final statement states, the last number's included, sorted."""


def read_final(text: str, question: str) -> FinalAnswer | None:
    """The last number of ``text`` and what its final statement states; None when ``text`` has no number."""
    found = numbers(text)
    if not found:
        return None
    last = found[-1]
    asked = {abs(n.value) for n in numbers(question)}
    start, end = final_statement(text, last)
    statement = [n for n in found if start <= n.start < end]
    operand = {n.start: is_operand(text, n) for n in statement}
    restated = None
    if operand[last.start] or last.divides_out:
        used = {abs(n.value) for n in statement if operand[n.start] or n is last}
        restated = RESTATED if used & asked else UNEVALUATED
    operands = {n.value for n in statement if operand[n.start]}  # a value used again is a step, not a candidate
    values = {n.value for n in statement if n.value not in operands and abs(n.value) not in asked} | {last.value}
    return FinalAnswer(last, restated, sorted(values))
