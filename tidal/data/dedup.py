"""Deduplication blocks: exact (normalized hash) and near-duplicate (MinHash + LSH banding).

Both keep the first row of each cluster in input order and drop the rest with the reason
``duplicate`` / ``near_duplicate``, so the output does not depend on the number of workers.

Near-duplicates (Broder 1997; the setup of FineWeb and datatrove's ``minhash.py``): a document's
word 5-grams are hashed with ``num_perm`` permutations (rensa's ``RMinHash``, a Rust MinHash: the
signature is the per-permutation minimum). Two documents with Jaccard similarity J agree on each
signature entry with probability J. LSH splits the signature into ``bands`` bands of ``rows``
entries; two documents become candidates when one band is identical, with probability
1 - (1 - J^rows)^bands: a steep S-curve around (1/bands)^(1/rows). A candidate pair counts as a
duplicate only if the share of equal entries over the whole signature (an unbiased estimate of J)
reaches ``threshold``, which removes most band-collision false positives. FineWeb's defaults: 5-grams,
14 bands x 8 rows = 112 permutations (S-curve midpoint ~0.72); we verify at J >= 0.7.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tidal.data.io import Row
from tidal.data.pipeline import Block
from tidal.data.text import normalize, shingles, words


def text_of(row: Row, key: str) -> str | None:
    value = row.get(key)
    return value if isinstance(value, str) else None


class ExactDedup(Block):
    name = "exact_dedup"

    def __init__(self, text_key: str = "text"):
        self.text_key = text_key
        self.seen: set[bytes] = set()

    def prepare(self, row: Row):
        text = text_of(row, self.text_key)
        return None if text is None else hashlib.blake2b(normalize(text).encode(), digest_size=16).digest()

    def decide(self, row: Row, digest) -> str | None:
        if digest is None:
            return f"no_{self.text_key}"
        if digest in self.seen:
            return "duplicate"
        self.seen.add(digest)
        return None

    def summary(self) -> dict:
        return {"distinct": len(self.seen)}


@dataclass
class NearDedupConfig:
    ngram: int = 5
    """Word n-gram size of the shingles (FineWeb: 5)."""
    bands: int = 14
    """LSH bands (FineWeb: 14)."""
    rows: int = 8
    """Signature entries per band (FineWeb: 8); num_perm = bands x rows."""
    threshold: float = 0.7
    """Estimated Jaccard similarity at or above which a candidate is a duplicate."""
    seed: int = 1


class NearDedup(Block):
    name = "near_dedup"

    def __init__(self, cfg: NearDedupConfig, text_key: str = "text"):
        assert cfg.bands >= 1 and cfg.rows >= 1, "bands and rows must be >= 1"
        assert 0 < cfg.threshold <= 1, f"threshold must be in (0, 1], got {cfg.threshold}"
        self.cfg = cfg
        self.text_key = text_key
        self.num_perm = cfg.bands * cfg.rows
        self.buckets: list[dict[bytes, int]] = [{} for _ in range(cfg.bands)]
        self.signatures: list[np.ndarray] = []  # kept documents' signatures, by cluster id
        self.cluster_sizes: list[int] = []

    def prepare(self, row: Row):
        from rensa import RMinHash

        text = text_of(row, self.text_key)
        if text is None:
            return None
        m = RMinHash(num_perm=self.num_perm, seed=self.cfg.seed)
        m.update(shingles(words(text), self.cfg.ngram))
        return np.asarray(m.digest(), dtype=np.uint32)

    def decide(self, row: Row, sig) -> str | None:
        if sig is None:
            return f"no_{self.text_key}"
        r = self.cfg.rows
        keys = [sig[b * r : (b + 1) * r].tobytes() for b in range(self.cfg.bands)]
        checked = set()
        for bucket, key in zip(self.buckets, keys):
            cid = bucket.get(key)
            if cid is not None and cid not in checked:
                checked.add(cid)
                if np.mean(self.signatures[cid] == sig) >= self.cfg.threshold:
                    self.cluster_sizes[cid] += 1
                    return "near_duplicate"
        cid = len(self.signatures)
        self.signatures.append(sig)
        self.cluster_sizes.append(1)
        for bucket, key in zip(self.buckets, keys):
            bucket.setdefault(key, cid)
        return None

    def summary(self) -> dict:
        return {"clusters": len(self.cluster_sizes), "clusters_with_duplicates": sum(s > 1 for s in self.cluster_sizes),
                "num_perm": self.num_perm}
