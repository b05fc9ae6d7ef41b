"""Math correctness: extract the response's final answer and check it against ``prompt.answer``.

Two steps, as in Magistral (arXiv 2506.10910, sec. 2.2, "correctness": the last ``\\boxed{}``
answer, compared with the reference by a rule-based, sympy-backed verifier):

1. *Extraction* (ours, plain regexes): the final answer is searched in the answer region (the text
   after ``</think>`` when the response thinks) in the configured ``formats``, in order, and the
   first format that occurs wins: ``boxed`` (``\\boxed{..}``/``\\fbox{..}``, braces matched; the
   last one), ``answer_tag`` (``<answer>..</answer>``, the last one), ``answer_is`` ("the answer
   is X" / "final answer: X", up to the end of the sentence; the last one).
2. *Equivalence* (math-verify's ``parse``/``verify``, no LaTeX parsing of our own): the extracted
   string and the gold answer (LaTeX or plain text) are parsed to sympy and compared symbolically
   and numerically, so ``\\frac12``, ``0.5`` and ``1/2`` are the same answer.

Modes. ``strict`` (default): only the configured formats count; no final answer scores 0.
``lenient``: when none of the formats occurs, fall back to math-verify's own extraction from the
answer region (its LaTeX/expression extraction, which takes the *last* expression it can parse). As
that reads only the last expression, a plain-number gold makes the fallback read the final statement
as prose too (``rewards/prose.py``): one stating several values ("33, 34 or 35") is hedging.

Reward hacking this resists (each scores 0, with ``details["reason"]``):
- *hedging*: several different answers in the winning format (``\\boxed{3} ... \\boxed{4}``);
  repeats of one answer (``\\boxed{1/2}`` then ``\\boxed{0.5}``) are fine; in the lenient fallback,
  several values in the final statement (above);
- *an answer hidden in the reasoning*: only the final-answer formats count, so a correct number in
  the text next to a wrong or missing final answer scores 0 (strict; lenient takes the last
  expression only); with ``after_think`` text inside ``<think>`` never counts, and an unclosed
  ``<think>`` has no answer at all;
- *repeating the question*: verbatim copies of the question are removed before extraction, and an
  answer that is an expression copied from the question (``\\boxed{2+3}`` for "What is 2+3?",
  which is symbolically equal to 5) is rejected unless it is literally the gold answer (plain
  numbers are exempt, e.g. multiple choice);
- *restating the question in other words* (issue 49: ``22+13 is 22+13.``, ``13+22``,
  ``\\frac{44+26}{2}``, ``35 \\cdot 1``): when the gold is a value, an answer with arithmetic left to
  do is not an answer, in every mode (``rewards/restate.py``: the rule and what counts as a value).

math-verify bounds its own work with ``signal.alarm``, which only works in a process's main thread
(the reward pool's workers). Elsewhere (``tidal score --workers 0`` from a thread, tests) its
timeouts are switched off and the pool's per-item timeout is the only bound. math-verify (and
sympy under it, ~0.7 s) is imported on first use, not by ``import tidal.rewards``.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.rewards.prose import parse_number, read_final
from tidal.rewards.restate import restatement
from tidal.types import Prompt

FORMATS = ("boxed", "answer_tag", "answer_is")
MODES = ("strict", "lenient")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
# "the answer is X", "final answer: X", "The final answer is $X$." up to a line end or a sentence end.
_ANSWER_IS = re.compile(r"(?:final answer|the answer)(?:\s+is)?\s*[:=]?\s*(.+?)(?=\n|\.\s|\.?$)", re.I)
# A prose word ends the expression after "the answer is": "5 because ..." -> "5". LaTeX commands
# (\\pi), words in braces (\\text{..}) and function calls (sqrt(2)) are not prose.
_PROSE = re.compile(r"(?<![\\\w{])[A-Za-z]{2,}(?![\w({^_])")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{..}``/``\\fbox{..}`` in order, nested braces matched; an unclosed
    box (a truncated response) is left out. One pass over the braces: linear even for a hostile
    response full of unclosed boxes."""
    starts = {m.end() - 1 for m in _BOXED.finditer(text)}  # positions of the boxes' opening braces
    if not starts:
        return []
    stack: list[int] = []
    found: list[tuple[int, str]] = []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            open_at = stack.pop()
            if open_at in starts:
                found.append((open_at, text[open_at + 1 : m.start()]))
    return [content for _, content in sorted(found)]


def _leading_expression(text: str) -> str:
    """The expression at the start of "the answer is ..." text: a delimited math span, or the text
    up to the first prose word (empty when it starts with prose: "the answer might be 42")."""
    s = text.strip()
    for left, right in _WRAPPERS[:4]:
        end = s.find(right, len(left)) if s.startswith(left) else -1
        if end > 0:
            return s[: end + len(right)]
    m = _PROSE.search(s)
    return s[: m.start()] if m else s


def _clean(answer: str) -> str:
    """Strip math delimiters, bold and final punctuation around an extracted answer."""
    s = answer.strip().rstrip(".,;:").strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s, changed = s[len(left) : -len(right)].strip(), True
    boxes = boxed_contents(s)
    return boxes[-1].strip() if boxes else s


def extract_answers(text: str, formats: tuple[str, ...] | list[str] = FORMATS) -> tuple[str | None, list[str]]:
    """``(format, answers)``: every non-empty answer of the first format in ``formats`` that occurs
    in ``text``, in order (the final answer is the last); ``(None, [])`` when none occurs."""
    for fmt in formats:
        if fmt == "boxed":
            found = boxed_contents(text)
        elif fmt == "answer_tag":
            found = _ANSWER_TAG.findall(text)
        else:
            found = [_leading_expression(x) for x in _ANSWER_IS.findall(text)]
        answers = [a for a in (_clean(x) for x in found) if a]
        if answers:
            return fmt, answers
    return None, []


def _squash(s: str) -> str:
    """A comparison key for literal (not symbolic) matching: no whitespace, ``$`` or ``\\!``."""
    return re.sub(r"\s+|\$|\\!|\\,", "", s)


@functools.lru_cache(maxsize=4096)
def _question_pattern(question: str) -> re.Pattern[str] | None:
    """The question as a regex that tolerates whitespace changes (a model re-wraps lines), matched
    only as whole words. None for a one-word question: a "copy" of it is not a copied question, and
    stripping it would cut letters out of real answers (question "q" would break ``\\sqrt``)."""
    words = question.split()
    if len(words) < 2:
        return None
    return re.compile(r"(?<!\w)" + r"\s+".join(map(re.escape, words)) + r"(?!\w)")


def strip_question(response: str, question: str) -> str:
    """``response`` with every verbatim copy of ``question`` removed (whitespace-insensitive)."""
    pattern = _question_pattern(question)
    return pattern.sub(" ", response) if pattern else response


def copied_from_question(answer: str, question: str, gold: str) -> bool:
    """True when ``answer`` is an expression that appears literally in ``question`` and is not
    literally ``gold``. Plain numbers are exempt (multiple choice, "is 7 prime?")."""
    a = _squash(answer)
    if not a or _PLAIN_NUMBER.fullmatch(a) or a == _squash(_clean(gold)):
        return False
    return a in _squash(question)


def answer_region(response: str, after_think: bool = True) -> str | None:
    """The part of ``response`` a final answer is read from: after the last ``</think>`` when the response
    thinks and ``after_think`` is on, else all of it; None for an unclosed ``<think>`` (no final answer)."""
    if not after_think or ("<think>" not in response and "</think>" not in response):
        return response
    return response.rsplit("</think>", 1)[1] if "</think>" in response else None


def _timeout(seconds: int | None) -> int | None:
    """math-verify's ``signal.alarm`` timeout works only in the main thread; None disables it."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def parse_answer(answer: str, timeout_s: int | None = None) -> list:
    """math-verify's parse of one extracted answer string (wrapped in ``\\boxed{}`` so its LaTeX
    extraction takes the whole string); ``[]`` when it cannot be parsed."""
    from math_verify import parse

    return parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int | None) -> tuple:
    """The gold answer parsed (cached: every sample of a group shares it): its last box if it has
    one, else the whole string as one expression, else math-verify's extraction from it."""
    from math_verify import parse

    boxes = boxed_contents(gold)
    return tuple(
        parse_answer(boxes[-1] if boxes else _clean(gold), timeout_s) or parse(gold, parsing_timeout=timeout_s)
    )


@dataclass
class MathReward:
    """``math``: 1.0 when the response's final answer is equivalent to ``prompt.answer``, else 0.0.

    See the module docstring for extraction, modes and the anti-hacking rules."""

    mode: str = "strict"
    """``strict``: only ``formats`` count; ``lenient``: fall back to math-verify's extraction of the
    last expression when none of them occurs."""
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    """Final-answer formats to look for, in priority order: ``boxed``, ``answer_tag``, ``answer_is``.
    Magistral (sec. 2.2) uses ``[boxed]`` only."""
    after_think: bool = True
    """When the response contains ``<think>``/``</think>``, search only after the last ``</think>``
    (an unclosed think block has no answer): thoughts may try candidates, the answer may not."""
    reject_copied: bool = True
    """Score 0 an answer that is an expression copied from the question (see the module docstring)."""
    reject_restated: bool = True
    """When the gold is a value, score 0 an answer with arithmetic left to do (``13+22`` for "What is
    22+13?", ``35 \\cdot 1``; ``rewards/restate.py``): math-verify would evaluate it to the gold."""
    timeout_s: int | None = 5
    """math-verify's own per-parse/per-comparison limit in whole seconds (its default 5); it uses
    ``signal.alarm``, so it applies in a main thread only; null disables it."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"math: mode must be one of {MODES}, got {self.mode!r}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise ConfigError(f"math: formats must be a non-empty subset of {FORMATS}, got {self.formats!r}")
        if self.timeout_s is not None and (not isinstance(self.timeout_s, int) or self.timeout_s < 1):
            raise ConfigError(
                f"math: timeout_s must be whole seconds >= 1 (signal.alarm) or null, got {self.timeout_s!r}"
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling happens in the pool's warm-up: import math-verify there, before any deadline runs.
        import math_verify  # noqa: F401

        self.__dict__.update(state)

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        from math_verify import parse, verify

        gold = prompt.answer.strip()
        if not gold:
            return 0.0, {"error": "empty gold answer", "reason": "empty gold answer"}
        timeout = _timeout(self.timeout_s)
        gold_parsed = list(_parse_gold(gold, timeout))
        details: dict[str, Any] = {"extracted": None, "gold_parsed": [str(g) for g in gold_parsed]}
        if not gold_parsed:
            return 0.0, {**details, "error": f"gold answer unparseable: {gold!r}", "reason": "gold unparseable"}

        def result(reason: str, correct: bool = False) -> tuple[float, dict[str, Any]]:
            return float(correct), {**details, "correct": correct, "reason": reason}

        region = answer_region(response, self.after_think)
        if region is None:
            return result("unfinished thinking: no </think>, so no final answer")
        region = strip_question(region, prompt.text)

        fmt, answers = extract_answers(region, self.formats)
        details["format"] = fmt
        if answers:
            extracted = answers[-1]
            parsed = parse_answer(extracted, timeout)
            for other in dict.fromkeys(a for a in answers if _squash(a) != _squash(extracted)):
                if not parsed or not verify(parsed, parse_answer(other, timeout), timeout_seconds=timeout):
                    details["extracted"], details["answers"] = extracted, answers
                    return result(f"multiple different answers ({fmt})")
        elif self.mode == "lenient":
            parsed = parse(region, parsing_timeout=timeout)
            extracted, details["format"] = (str(parsed[-1]) if parsed else None), "fallback"
            final = read_final(region, prompt.text) if parsed and parse_number(gold) is not None else None
            if final is not None and not final.restated and len(final.values) > 1:  # "33, 34 or 35": it reads 35
                details["extracted"], details["answers"] = extracted, [str(v) for v in final.values]
                return result("multiple different answers (fallback)")
        else:
            return result(f"no final answer in {self.formats}")
        details["extracted"] = extracted
        details["parsed"] = [str(p) for p in parsed]
        if not parsed:
            return result("no final answer" if extracted is None else "answer unparseable")
        if self.reject_copied and copied_from_question(extracted, prompt.text, gold):
            return result("answer copied from the question")
        if self.reject_restated:
            # The fallback's parse can drop what its own extracted text shows ("052*1" parses to 52 there).
            forms = parsed if answers else [*parsed, *parse_answer(extracted, timeout)]
            why = restatement(extracted, forms, _clean(gold), gold_parsed, prompt.text)
            if why:
                return result(why)
        correct = verify(gold_parsed, parsed, timeout_seconds=timeout)
        return result("correct" if correct else "wrong answer", correct)


REWARDS.register("math")(MathReward)
