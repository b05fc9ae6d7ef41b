"""Heuristic quality filters and language identification, each a stateless block whose drop reason
names the rule that fired.

- ``GopherQuality``: the document-level rules of Gopher's MassiveText filter (Rae et al. 2021,
  arXiv 2112.11446, appendix A.1.1): 50-100,000 words, mean word length 3-10 characters, at most
  0.1 hash or ellipsis symbols per word, at most 90% of lines starting with a bullet, at most 30% of
  lines ending with an ellipsis, at least 80% of words containing a letter, and at least 2 of the
  stop words "the, be, to, of, and, that, have, with".
- ``GopherRepetition``: the same paper's repetition rules: duplicate lines <= 30% of lines and
  <= 20% of characters, duplicate paragraphs <= 30% / 20%; the most frequent 2/3/4-gram covers at
  most 20/18/16% of characters; characters inside duplicated 5..10-grams at most 15..10%.
- ``C4Filter``: the document-level rules of C4 (Raffel et al. 2020, sec. 2.2): drop pages with
  "lorem ipsum", a curly bracket, or fewer than 3 sentences.
- ``LanguageFilter``: py3langid (langid.py's model inside the wheel, no download at run time);
  keep the listed languages at a normalized probability >= ``min_prob`` (FineWeb keeps English at
  fastText score >= 0.65).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from tidal.data.pipeline import TextFilter

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "–", "-", "*", "·")
_WORD = re.compile(r"\S+")
_SENTENCE_END = re.compile(r"[.!?](\s|$)")


@dataclass
class GopherQualityConfig:
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_len: float = 3.0
    max_mean_word_len: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8
    min_stop_words: int = 2


class GopherQuality(TextFilter):
    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig, text_key: str = "text"):
        self.cfg, self.text_key = cfg, text_key

    def check(self, text: str) -> str | None:
        c = self.cfg
        tokens = _WORD.findall(text)
        n = len(tokens)
        if n < c.min_words:
            return "too_few_words"
        if n > c.max_words:
            return "too_many_words"
        mean_len = sum(map(len, tokens)) / n
        if not c.min_mean_word_len <= mean_len <= c.max_mean_word_len:
            return "mean_word_length"
        if (text.count("#") + text.count("...") + text.count("…")) / n > c.max_symbol_word_ratio:
            return "symbol_word_ratio"
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            if sum(line.lstrip().startswith(_BULLETS) for line in lines) / len(lines) > c.max_bullet_lines:
                return "bullet_lines"
            if sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines) > c.max_ellipsis_lines:
                return "ellipsis_lines"
        if sum(any(ch.isalpha() for ch in t) for t in tokens) / n < c.min_alpha_words:
            return "alpha_words"
        if len(STOP_WORDS.intersection(t.lower() for t in tokens)) < c.min_stop_words:
            return "stop_words"
        return None


@dataclass
class GopherRepetitionConfig:
    max_dup_line_frac: float = 0.3
    max_dup_line_char_frac: float = 0.2
    max_dup_para_frac: float = 0.3
    max_dup_para_char_frac: float = 0.2
    top_ngram_char_frac: dict[int, float] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram_char_frac: dict[int, float] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})


def _dup_fracs(parts: list[str]) -> tuple[float, float]:
    """Share of elements that repeat an earlier one, and share of characters in them."""
    seen, dup, dup_chars = set(), 0, 0
    for p in parts:
        if p in seen:
            dup += 1
            dup_chars += len(p)
        seen.add(p)
    total_chars = sum(map(len, parts)) or 1
    return dup / max(len(parts), 1), dup_chars / total_chars


def top_ngram_char_frac(tokens: list[str], n: int) -> float:
    """Characters covered by the most frequent n-gram's occurrences, over all word characters."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    if not grams:
        return 0.0
    gram, count = grams.most_common(1)[0]
    return sum(map(len, gram)) * count / max(sum(map(len, tokens)), 1)


def dup_ngram_char_frac(tokens: list[str], n: int) -> float:
    """Characters of words inside any n-gram that occurs more than once (each word counted once)."""
    first: dict[tuple, int] = {}
    covered = [False] * len(tokens)
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i : i + n])
        j = first.setdefault(g, i)
        if j != i:
            for k in range(n):
                covered[i + k] = covered[j + k] = True
    return sum(len(t) for t, c in zip(tokens, covered) if c) / max(sum(map(len, tokens)), 1)


class GopherRepetition(TextFilter):
    name = "gopher_repetition"

    def __init__(self, cfg: GopherRepetitionConfig, text_key: str = "text"):
        self.cfg, self.text_key = cfg, text_key

    def check(self, text: str) -> str | None:
        c = self.cfg
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        frac, chars = _dup_fracs(lines)
        if frac > c.max_dup_line_frac:
            return "dup_lines"
        if chars > c.max_dup_line_char_frac:
            return "dup_line_chars"
        paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        frac, chars = _dup_fracs(paras)
        if frac > c.max_dup_para_frac:
            return "dup_paragraphs"
        if chars > c.max_dup_para_char_frac:
            return "dup_paragraph_chars"
        tokens = text.lower().split()
        for n, limit in sorted(c.top_ngram_char_frac.items()):
            if top_ngram_char_frac(tokens, n) > limit:
                return f"top_{n}gram"
        for n, limit in sorted(c.dup_ngram_char_frac.items()):
            if dup_ngram_char_frac(tokens, n) > limit:
                return f"dup_{n}gram"
        return None


class C4Filter(TextFilter):
    name = "c4"

    def __init__(self, min_sentences: int = 3, text_key: str = "text"):
        self.min_sentences, self.text_key = min_sentences, text_key

    def check(self, text: str) -> str | None:
        if "lorem ipsum" in text.lower():
            return "lorem_ipsum"
        if "{" in text or "}" in text:
            return "curly_bracket"
        if len(_SENTENCE_END.findall(text)) < self.min_sentences:
            return "too_few_sentences"
        return None


@dataclass
class LanguageConfig:
    languages: list[str] = field(default_factory=lambda: ["en"])
    min_prob: float = 0.65


class LanguageFilter(TextFilter):
    name = "language"

    def __init__(self, cfg: LanguageConfig, text_key: str = "text"):
        self.cfg, self.text_key = cfg, text_key
        self._ident = None

    def __getstate__(self):  # the identifier is rebuilt in each worker, not pickled
        return {**self.__dict__, "_ident": None}

    def check(self, text: str) -> str | None:
        if self._ident is None:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier

            self._ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        lang, prob = self._ident.classify(text)
        if lang not in self.cfg.languages:
            return f"language_{lang}"
        if prob < self.cfg.min_prob:
            return "language_low_confidence"
        return None
