"""Synthetic corpora with planted duplicates, contamination and known-quality documents."""

from __future__ import annotations

import random

STOP = ["the", "be", "to", "of", "and", "that", "have", "with"]


def vocabulary(rng: random.Random, size: int = 3000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(size)]


def document(rng: random.Random, vocab: list[str], num_words: int = 300) -> str:
    """Prose-like: sentences of 8-16 words, stop words mixed in, a full stop after each."""
    sentences, n = [], 0
    while n < num_words:
        k = rng.randint(8, 16)
        ws = [rng.choice(STOP) if rng.random() < 0.25 else rng.choice(vocab) for _ in range(k)]
        sentences.append(" ".join(ws).capitalize() + ".")
        n += k
    return " ".join(sentences)


def near_copy(rng: random.Random, text: str, vocab: list[str], edits: int = 3) -> str:
    """A few word substitutions plus a changed first sentence case: Jaccard of 5-grams stays high."""
    ws = text.split()
    for _ in range(edits):
        ws[rng.randrange(len(ws))] = rng.choice(vocab)
    return " ".join(ws)


def corpus_with_duplicates(seed: int = 0, originals: int = 300, exact: int = 40, near: int = 60):
    """Rows with ids; returns (rows, exact_ids, near_ids): the ids of planted copies (the original
    always comes first in the stream)."""
    rng = random.Random(seed)
    vocab = vocabulary(rng)
    docs = [document(rng, vocab) for _ in range(originals)]
    rows = [{"id": f"doc{i}", "text": d} for i, d in enumerate(docs)]
    exact_ids, near_ids = set(), set()
    for j in range(exact):  # the same text up to case, punctuation and spacing
        src = docs[rng.randrange(originals)]
        rows.append({"id": f"exact{j}", "text": "  " + src.upper().replace(".", " !") + "\n"})
        exact_ids.add(f"exact{j}")
    for j in range(near):
        rows.append({"id": f"near{j}", "text": near_copy(rng, docs[rng.randrange(originals)], vocab)})
        near_ids.add(f"near{j}")
    head, tail = rows[:originals], rows[originals:]
    rng.shuffle(tail)  # copies after their originals, interleaved with each other
    return head + tail, exact_ids, near_ids
