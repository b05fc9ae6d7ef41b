"""Text normalization shared by the dedup and decontamination blocks: the same document written with
different case, punctuation or spacing must hash and shingle the same."""

from __future__ import annotations

import re
import unicodedata

_PUNCT = re.compile(r"[^\w\s]", flags=re.UNICODE)


def normalize(text: str) -> str:
    """NFKC, lower case, punctuation removed, whitespace collapsed (the normalization of exact-match
    dedup in CCNet and of the GPT-3 decontamination n-grams)."""
    return " ".join(words(text))


def words(text: str) -> list[str]:
    """The normalized words of ``text`` (split() collapses whitespace: a regex for it costs 3x)."""
    return _PUNCT.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


def shingles(tokens: list[str], n: int) -> list[str]:
    """Word n-grams joined by spaces; a text shorter than n words is one shingle (so it still has a
    signature and can match an identical short text)."""
    if len(tokens) <= n:
        return [" ".join(tokens)] if tokens else []
    return list(map(" ".join, zip(*(tokens[i:] for i in range(n)))))  # 1.8x a slicing comprehension
