"""Decontamination: drop training rows that share a long word n-gram with an evaluation set.

GPT-3 (Brown et al. 2020, appendix C) flagged overlap by 13-grams of normalized words; the same
test is used by most post-training pipelines since (default ``ngram=13``). Evaluation items shorter
than ``ngram`` words (many math problems) would never match that way, so such an item's whole word
sequence is used as its n-gram when it has at least ``min_words`` words, and shorter items match
only an identical normalized text. Every removed row is reported with the evaluation item and the
n-gram it shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import ConfigError
from tidal.data.io import Row, read_numbered
from tidal.data.pipeline import Block
from tidal.data.text import words

EVAL_FIELDS = ("text", "prompt", "question", "problem")


@dataclass
class DecontamConfig:
    ngram: int = 13
    """Word n-gram length (GPT-3's decontamination: 13)."""
    min_words: int = 8
    """Evaluation items shorter than ``ngram`` but with at least this many words match as a whole."""
    fields: list[str] = field(default_factory=lambda: list(EVAL_FIELDS))
    """Fields read from evaluation rows and checked in training rows (each one that is present)."""


def _texts(row: Row, fields: list[str]) -> list[str]:
    return [row[f] for f in fields if isinstance(row.get(f), str)]


class Decontaminate(Block):
    name = "decontaminate"
    keep_all_examples = True

    def __init__(self, cfg: DecontamConfig, eval_paths: list[str | Path]):
        if not eval_paths:
            raise ConfigError("decontaminate needs evaluation sets: --set eval=PATH (or eval=[A, B])")
        self.cfg = cfg
        self.grams: dict[int, dict[str, str]] = {}  # n-gram length -> n-gram -> evaluation item id
        self.exact: dict[str, str] = {}
        self.num_eval_items = 0
        for path in eval_paths:
            for i, row in read_numbered(path):
                texts = _texts(row, cfg.fields)
                if not texts:
                    raise ValueError(f"{path}:{i}: the evaluation row has none of the fields {cfg.fields}")
                self.num_eval_items += 1
                for text in texts:
                    self._index(text, f"{Path(path).name}:{i}")

    def _index(self, text: str, item: str) -> None:
        w = words(text)
        n = self.cfg.ngram
        if len(w) >= n:
            table = self.grams.setdefault(n, {})
            for k in range(len(w) - n + 1):
                table.setdefault(" ".join(w[k : k + n]), item)
        elif len(w) >= self.cfg.min_words:
            self.grams.setdefault(len(w), {}).setdefault(" ".join(w), item)
        elif w:
            self.exact.setdefault(" ".join(w), item)

    def prepare(self, row: Row):
        """The first (evaluation item, shared n-gram) of the row, or None."""
        for text in _texts(row, self.cfg.fields):
            w = words(text)
            if (item := self.exact.get(" ".join(w))) is not None:
                return item, " ".join(w)
            for n, table in self.grams.items():
                for k in range(len(w) - n + 1):
                    gram = " ".join(w[k : k + n])
                    if (item := table.get(gram)) is not None:
                        return item, gram
        return None

    def decide(self, row: Row, match) -> str | None:
        self.detail = None if match is None else {"eval_item": match[0], "ngram": match[1]}
        return None if match is None else "contaminated"

    def summary(self) -> dict:
        return {"eval_items": self.num_eval_items, "ngrams": sum(len(t) for t in self.grams.values())}


