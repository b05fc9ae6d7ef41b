"""A trainable quality classifier in the fastText style (Joulin et al. 2017, "Bag of Tricks"):
hashed word unigrams and bigrams, averaged embeddings, one linear layer. FineWeb-edu trained a
regressor on LLM-annotated educational scores 0-5 and kept documents scoring >= 3; DCLM used a
fastText classifier the same way. Labels here are numbers: 0/1 for good/bad examples, or a score
scale such as FineWeb-edu's; the model regresses them and the ``quality_classifier`` block keeps
rows whose predicted score is >= ``threshold``.

    tidal curate train-classifier --in labeled.jsonl --out quality_model --set epochs=5
    tidal curate quality --in raw.jsonl --out kept.jsonl \\
        --set "blocks=[quality_classifier]" --set classifier.path=quality_model --set classifier.threshold=0.5

Hashing (CRC32, the same in every process) keeps the model a fixed size whatever the vocabulary.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.data.dedup import text_of
from tidal.data.io import read_numbered
from tidal.data.pipeline import TextFilter
from tidal.data.text import words


@dataclass
class ClassifierConfig:
    path: str = ""
    """Directory written by ``train-classifier`` (the block's model)."""
    threshold: float = 0.5
    """Keep rows whose predicted score is >= this (FineWeb-edu: 3 on its 0-5 scale)."""


@dataclass
class TrainClassifierConfig:
    text_key: str = "text"
    label_key: str = "label"
    buckets: int = 2**20
    """Hash buckets for unigrams and bigrams (fastText's default is 2M)."""
    dim: int = 16
    epochs: int = 5
    lr: float = 0.05
    batch_size: int = 32
    holdout: float = 0.1
    """Share of rows held out to report accuracy (0/1 labels) or mean absolute error."""
    seed: int = 0
    threads: int = 1
    max_words: int = 2000
    """Words read per document (long documents cost time and add little)."""


def features(text: str, buckets: int, max_words: int) -> list[int]:
    """Bucket ids of the word unigrams and bigrams (normalized words, CRC32 hashed)."""
    ws = words(text)[:max_words]
    grams = ws + [f"{a} {b}" for a, b in zip(ws, ws[1:])]
    return [zlib.crc32(g.encode()) % buckets for g in grams] or [0]


def _model(buckets: int, dim: int):
    import torch

    class FastText(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(buckets, dim, mode="mean")
            self.out = torch.nn.Linear(dim, 1)

        def forward(self, ids, offsets):
            return self.out(self.embed(ids, offsets)).squeeze(-1)

    return FastText()


def _batch(feats: list[list[int]]):
    import torch

    offsets = torch.tensor([0] + [len(f) for f in feats[:-1]]).cumsum(0)
    return torch.tensor([i for f in feats for i in f]), offsets


def train_classifier(in_path: str | Path, out_dir: str | Path, cfg: TrainClassifierConfig) -> dict:
    """Train on labeled rows; write ``model.pt`` and ``config.json`` to ``out_dir``; return metrics."""
    import torch

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    data = []
    for i, row in read_numbered(in_path):
        text, label = text_of(row, cfg.text_key), row.get(cfg.label_key)
        if text is None or isinstance(label, bool) or not isinstance(label, (int, float)):
            raise ValueError(f"{in_path}:{i}: the row needs a string {cfg.text_key!r} and a numeric {cfg.label_key!r}")
        data.append((features(text, cfg.buckets, cfg.max_words), float(label)))
    if len(data) < 4:
        raise ValueError(f"{in_path}: {len(data)} labeled rows; need at least 4")
    random.Random(cfg.seed).shuffle(data)
    n_hold = max(1, int(len(data) * cfg.holdout)) if cfg.holdout > 0 else 0
    hold, train = data[:n_hold], data[n_hold:]
    model = _model(cfg.buckets, cfg.dim)
    # Sparse-friendly plain SGD on the bag as in fastText would need sparse grads; Adam on a 16-dim
    # table converges in a few epochs at this size.
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.epochs):
        random.Random(cfg.seed + _).shuffle(train)
        for k in range(0, len(train), cfg.batch_size):
            chunk = train[k : k + cfg.batch_size]
            ids, offsets = _batch([f for f, _ in chunk])
            loss = torch.nn.functional.mse_loss(model(ids, offsets), torch.tensor([y for _, y in chunk]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    metrics = {"train_rows": len(train), "holdout_rows": len(hold)}
    if hold:
        with torch.no_grad():
            ids, offsets = _batch([f for f, _ in hold])
            pred = model(ids, offsets)
        y = torch.tensor([y for _, y in hold])
        metrics["holdout_mae"] = float((pred - y).abs().mean())
        if set(y.tolist()) <= {0.0, 1.0}:
            metrics["holdout_accuracy"] = float(((pred >= 0.5).float() == y).float().mean())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # temporary names renamed into place: an interrupted save never leaves a truncated model behind
    torch.save(model.state_dict(), out / "model.pt.tmp")
    (out / "config.json.tmp").write_text(json.dumps({**asdict(cfg), "metrics": metrics}, indent=2))
    (out / "model.pt.tmp").replace(out / "model.pt")
    (out / "config.json.tmp").replace(out / "config.json")
    return metrics


class QualityClassifier(TextFilter):
    """Keeps rows whose predicted quality score is >= ``threshold``; the model loads lazily in each
    worker process (torch is never touched before the pool forks)."""

    name = "quality_classifier"

    def __init__(self, cfg: ClassifierConfig, text_key: str = "text"):
        from tidal.config import ConfigError

        if not cfg.path or not (Path(cfg.path) / "config.json").exists():
            raise ConfigError(f"quality_classifier needs classifier.path=DIR from `tidal curate train-classifier` "
                              f"(got {cfg.path!r})")
        self.cfg, self.text_key = cfg, text_key
        self.meta = json.loads((Path(cfg.path) / "config.json").read_text())
        self._model = None

    def __getstate__(self):
        return {**self.__dict__, "_model": None}

    def score(self, text: str) -> float:
        import torch

        if self._model is None:
            torch.set_num_threads(1)
            self._model = _model(self.meta["buckets"], self.meta["dim"])
            self._model.load_state_dict(torch.load(Path(self.cfg.path) / "model.pt", weights_only=True))
            self._model.eval()
        with torch.no_grad():
            ids, offsets = _batch([features(text, self.meta["buckets"], self.meta["max_words"])])
            return float(self._model(ids, offsets)[0])

    def check(self, text: str) -> str | None:
        return None if self.score(text) >= self.cfg.threshold else "low_quality_score"
