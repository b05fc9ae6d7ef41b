"""Language consistency: are the problem, the thoughts and the answer in one language?

Magistral (arXiv 2506.10910, sec. 2.2, "language consistency") keeps a multilingual model from
switching languages mid-response: it removes LaTeX and code from the problem, the thoughts and the
answer, classifies each with a fastText language classifier, and adds 0.1 to the reward when all
three are the same language. Here the score is 1.0 (same) or 0.0 (different); give the term weight
0.1 in ``compose`` to get Magistral's reward.

The classifier is py3langid (langid.py's model, shipped inside the wheel: no download at run time;
loaded once per process, ~0.6 s). Before classifying, fenced and inline code, math (``$..$``,
``$$..$$``, ``\\(..\\)``, ``\\[..\\]``, ``\\begin..\\end``), LaTeX commands, tags, numbers and
symbols are removed. Segments: the problem is ``prompt.text``; the thoughts are inside
``<think>..</think>``; the answer is the text after ``</think>`` (the whole response when it has no
think block; the thoughts are then missing).

A segment that cannot be classified (fewer than ``min_letters`` letters left, e.g. an answer that
is only ``\\boxed{5}``, or a confidence below ``min_confidence``) is handled by ``on_unknown``:
``ignore`` (default: only the classified segments must agree; none or one classified passes) or
``fail`` (score 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.types import Prompt

ON_UNKNOWN = ("ignore", "fail")

_STRIP = [
    re.compile(r"```.*?(?:```|$)", re.S),  # fenced code (an unclosed fence runs to the end)
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\$\$.*?\$\$|\\\[.*?\\\]|\\\(.*?\\\)|\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.S),  # display math
    re.compile(r"\$[^$]*\$"),  # inline math
    re.compile(r"</?\w+>"),  # tags such as <think>
    re.compile(r"\\[A-Za-z]+"),  # leftover LaTeX commands (\boxed, \frac ...)
    re.compile(r"[\d_^{}\\=+\-*/<>|()\[\]]+"),  # numbers and math symbols
]

_IDENTIFIERS: dict[tuple[str, ...] | None, Any] = {}


def _identifier(languages: tuple[str, ...] | None) -> Any:
    """One py3langid identifier per candidate-language set, built on first use in each process."""
    if languages not in _IDENTIFIERS:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        if languages:
            ident.set_languages(list(languages))
        _IDENTIFIERS[languages] = ident
    return _IDENTIFIERS[languages]


def strip_non_prose(text: str) -> str:
    """``text`` without code, math, LaTeX commands, tags, numbers and symbols (whitespace collapsed)."""
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    return " ".join(text.split())


def split_segments(response: str, problem: str) -> dict[str, str | None]:
    """``{problem, thoughts, answer}`` texts; ``thoughts`` is None when there is no think block."""
    if "</think>" in response:
        head, _, answer = response.rpartition("</think>")
        thoughts: str | None = head.split("<think>", 1)[-1]
    else:
        thoughts, answer = None, response
    return {"problem": problem, "thoughts": thoughts, "answer": answer}


@dataclass
class LanguageReward:
    """``language``: 1.0 when the problem, thoughts and answer are one language, else 0.0."""

    min_letters: int = 10
    """A segment with fewer letters (after stripping math/code) is unclassifiable."""
    min_confidence: float = 0.5
    """A segment whose top language has a lower (normalized) probability is unclassifiable."""
    on_unknown: str = "ignore"
    """An unclassifiable or missing segment: ``ignore`` it or ``fail`` (score 0)."""
    languages: list[str] | None = field(default=None)
    """Restrict the classifier to these ISO 639-1 codes (e.g. ``[en, fr, zh]``): more accurate on
    short text. None: every language the model knows."""

    def __post_init__(self) -> None:
        if self.on_unknown not in ON_UNKNOWN:
            raise ConfigError(f"language: on_unknown must be one of {ON_UNKNOWN}, got {self.on_unknown!r}")

    def classify(self, text: str | None) -> tuple[str | None, float]:
        """``(language, probability)``; language None when the text cannot be classified."""
        prose = strip_non_prose(text or "")
        if sum(c.isalpha() for c in prose) < self.min_letters:
            return None, 0.0
        lang, prob = _identifier(tuple(self.languages) if self.languages else None).classify(prose)
        return (lang if prob >= self.min_confidence else None), float(prob)

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        langs: dict[str, str | None] = {}
        confidence: dict[str, float] = {}
        for name, text in split_segments(response, prompt.text).items():
            langs[name], confidence[name] = self.classify(text)
        details: dict[str, Any] = {"languages": langs, "confidence": confidence}
        unknown = [name for name, lang in langs.items() if lang is None]
        if unknown and self.on_unknown == "fail":
            return 0.0, {**details, "reason": f"cannot classify {', '.join(unknown)}"}
        known = {lang for lang in langs.values() if lang is not None}
        if len(known) > 1:
            return 0.0, {**details, "reason": f"mixed languages {sorted(known)}"}
        return 1.0, {**details, "reason": f"consistent ({next(iter(known), 'nothing classifiable')})"}


REWARDS.register("language")(LanguageReward)
