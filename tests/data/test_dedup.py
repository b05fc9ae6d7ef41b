import random

import pytest

from tests.data.corpus import corpus_with_duplicates, document, vocabulary
from tidal.data.dedup import ExactDedup, NearDedup, NearDedupConfig
from tidal.data.pipeline import Pipeline
from tidal.data.text import normalize, shingles


def test_normalize_ignores_case_punctuation_and_spacing():
    assert normalize("  Hello,\tWORLD!!  ok. ") == "hello world ok"
    assert shingles(["a", "b", "c"], 2) == ["a b", "b c"]
    assert shingles(["a"], 5) == ["a"]  # short texts still get one shingle


def _kept_ids(blocks, rows, workers=1):
    return {r["id"] for r in Pipeline(blocks, workers=workers, chunk_size=64).run(rows)}


def test_exact_dedup_keeps_the_first_of_each_normalized_text():
    rows = [{"id": 1, "text": "A b."}, {"id": 2, "text": "a B"}, {"id": 3, "text": "c"}, {"id": 4}]
    p = Pipeline([ExactDedup()])
    assert [r["id"] for r in p.run(rows)] == [1, 3]
    stats = p.report()["blocks"][0]
    assert stats["dropped"] == {"duplicate": 1, "no_text": 1} and stats["seen"] == 4 and stats["kept"] == 2


@pytest.mark.parametrize("workers", [1, 2])
def test_near_dedup_recall_and_precision_on_planted_duplicates(workers):
    rows, exact_ids, near_ids = corpus_with_duplicates(seed=0)
    kept = _kept_ids([ExactDedup(), NearDedup(NearDedupConfig())], rows, workers)
    planted = exact_ids | near_ids
    removed = {r["id"] for r in rows} - kept
    recall = len(removed & planted) / len(planted)
    precision = len(removed & planted) / max(len(removed), 1)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)
    assert all(f"doc{i}" in kept for i in range(300))  # the originals (first in the stream) stay


def test_near_dedup_estimates_jaccard_and_respects_the_threshold():
    rng = random.Random(1)
    vocab = vocabulary(rng)
    a = document(rng, vocab, 200).split()
    b = a[:100] + document(rng, vocab, 100).split()  # half shared: Jaccard of 5-grams ~1/3
    rows = [{"id": "a", "text": " ".join(a)}, {"id": "b", "text": " ".join(b)}]
    assert _kept_ids([NearDedup(NearDedupConfig())], rows) == {"a", "b"}  # 1/3 < 0.7: both stay
    loose = NearDedupConfig(bands=64, rows=2, threshold=0.2)  # a lower bar finds the pair
    assert _kept_ids([NearDedup(loose)], rows) == {"a"}


def test_the_output_does_not_depend_on_the_number_of_workers():
    rows, _, _ = corpus_with_duplicates(seed=3, originals=100, exact=10, near=20)
    assert _kept_ids([NearDedup(NearDedupConfig())], rows, 1) == _kept_ids([NearDedup(NearDedupConfig())], rows, 2)


def test_ray_executor_gives_the_local_output(local_ray):
    from tidal.data.quality import GopherQuality, GopherQualityConfig

    rows, _, _ = corpus_with_duplicates(seed=4, originals=60, exact=5, near=10)
    blocks = lambda: [GopherQuality(GopherQualityConfig()), NearDedup(NearDedupConfig())]  # noqa: E731
    local, remote = Pipeline(blocks(), chunk_size=32), Pipeline(blocks(), chunk_size=32, executor="ray")
    assert list(remote.run(rows)) == list(local.run(rows))
    drop_times = lambda rep: [{k: v for k, v in b.items() if k not in ("seconds", "rows_per_s")}  # noqa: E731
                              for b in rep["blocks"]]
    assert drop_times(remote.report()) == drop_times(local.report())
    assert remote.report()["workers"] == 2
