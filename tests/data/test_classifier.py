import json
import random

import pytest

from tests.data.corpus import document, vocabulary
from tidal.cli import main
from tidal.data.classifier import ClassifierConfig, QualityClassifier, features
from tidal.data.io import read_rows, write_rows


def spam(rng: random.Random, vocab: list[str]) -> str:
    """Keyword stuffing and symbols: what a quality classifier should learn to reject."""
    keys = [rng.choice(["buy", "cheap", "free", "click", "win", "offer", "now", "$$$", "!!!"]) for _ in range(60)]
    return " ".join(keys + [rng.choice(vocab) for _ in range(20)])


def labeled(seed: int, n: int):
    rng = random.Random(seed)
    vocab = vocabulary(rng)
    return [{"text": document(rng, vocab, 80), "label": 1} if i % 2 else {"text": spam(rng, vocab), "label": 0}
            for i in range(n)]


def test_features_are_stable_hashed_unigrams_and_bigrams():
    f = features("Hello, world!", 1000, 100)
    assert len(f) == 3 and all(0 <= i < 1000 for i in f)  # hello, world, "hello world"
    assert f == features("hello WORLD", 1000, 100)


def test_train_then_filter_separates_good_from_spam(tmp_path, capsys):
    write_rows(tmp_path / "train.jsonl", labeled(0, 400))
    assert main(["curate", "train-classifier", "--in", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "m"),
                 "--set", "epochs=3", "--set", "buckets=65536"]) == 0
    metrics = json.loads((tmp_path / "m" / "config.json").read_text())["metrics"]
    assert metrics["holdout_accuracy"] >= 0.95
    test_rows = labeled(1, 100)
    write_rows(tmp_path / "raw.jsonl", test_rows)
    assert main(["curate", "quality", "--in", str(tmp_path / "raw.jsonl"), "--out", str(tmp_path / "kept.jsonl"),
                 "--set", "blocks=[quality_classifier]", "--set", f"classifier.path={tmp_path / 'm'}",
                 "--set", "workers=2"]) == 0
    kept = list(read_rows(tmp_path / "kept.jsonl"))
    good = sum(r["label"] == 1 for r in kept)
    assert good >= 48 and len(kept) - good <= 2  # keeps the prose, drops the spam


def test_missing_model_and_bad_labels_are_clear_errors(tmp_path):
    from tidal.config import ConfigError
    from tidal.data.classifier import TrainClassifierConfig, train_classifier

    with pytest.raises(ConfigError, match="classifier.path"):
        QualityClassifier(ClassifierConfig(path=str(tmp_path / "nope")))
    write_rows(tmp_path / "bad.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "good"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: the row needs"):  # 1-based, as an editor numbers lines
        train_classifier(tmp_path / "bad.jsonl", tmp_path / "m", TrainClassifierConfig())
