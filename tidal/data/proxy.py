"""Compare data recipes with small proxy models, the reduced-learning-rate way.

Proxy practice trains one small model per candidate dataset with one fixed configuration and ranks
the datasets by held-out loss. "Can Small Training Runs Reliably Guide Data Curation?" (Wang et al.,
arXiv 2512.24503) shows that ranking can flip with small changes of the learning rate, because each
dataset has its own best configuration, and that proxies trained with a sufficiently *small*
learning rate rank datasets the way fully tuned large runs do. So ``tidal curate compare`` trains
every dataset at ``lr`` (small by default) over several seeds, ranks them by mean held-out loss,
reports the spread, and optionally repeats at ``compare_lrs`` (e.g. a usual proxy rate) to show
whether the conclusion depends on the rate.

The proxy is tidal's tiny character-level Qwen2 trained as a language model on the dataset's
``text`` (lower-cased: the tiny tokenizer's alphabet) with AdamW; the held-out loss is the mean
next-character loss on fixed windows of the shared evaluation texts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tidal.data.dedup import text_of
from tidal.data.io import read_rows
from tidal.utils.progress import progress_bar


@dataclass
class ProxyConfig:
    datasets: list[str] = field(default_factory=list)
    """The candidate datasets (curated outputs), each a JSONL/Parquet/HF path with ``text_key``."""
    eval: str = ""
    """The shared held-out texts."""
    text_key: str = "text"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 96
    lr: float = 3e-4
    """The proxy's learning rate: reduced (the paper's patch); the tiny model's usual rate is 1e-3."""
    compare_lrs: list[float] = field(default_factory=list)
    """Also rank at these rates, to show whether the conclusion depends on the rate."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    hidden_size: int = 64
    num_layers: int = 2
    eval_windows: int = 64
    threads: int = 0


def _encode(tokenizer, texts: list[str]):
    import torch

    eos = tokenizer.eos_token_id
    ids = [i for t in texts for i in (*tokenizer(t.lower(), add_special_tokens=False).input_ids, eos)]
    return torch.tensor(ids, dtype=torch.long)


def _texts(path: str, key: str) -> list[str]:
    texts = [t for row in read_rows(path) if (t := text_of(row, key))]
    if not texts:
        raise ValueError(f"{path}: no rows with a string {key!r}")
    return texts


def build_proxy(cfg: ProxyConfig, seed: int):
    """A fresh tiny LM (seeded init) and its AdamW, both as ``proxy_loss`` trains them."""
    import torch

    from tidal.models import tiny

    mcfg = tiny.ModelConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=4, num_kv_heads=4,
                            intermediate_size=4 * cfg.hidden_size, max_position_embeddings=cfg.seq_len + 1,
                            init_seed=seed)
    model = tiny.build_model(mcfg, tiny.build_tokenizer()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return model, opt


def train_step(model, opt, batch) -> float:
    """One clipped AdamW step of next-character loss on ``batch`` [B, seq_len + 1]."""
    import torch

    loss = model(input_ids=batch, labels=batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def held_out_loss(model, eval_windows) -> float:
    """Mean next-character loss on the fixed evaluation windows (the model is left in train mode)."""
    import torch

    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=eval_windows, labels=eval_windows).loss)
    model.train()
    return loss


def windows(eval_ids, cfg: ProxyConfig, where: str):
    """``cfg.eval_windows`` evenly spaced windows of seq_len + 1 tokens over ``eval_ids``."""
    import torch

    n = cfg.seq_len + 1
    count = min(cfg.eval_windows, len(eval_ids) // n)
    if count == 0:
        raise ValueError(f"{where}: fewer than seq_len+1={n} characters of evaluation text")
    stride = (len(eval_ids) - n) // max(count - 1, 1) if count > 1 else 0
    return torch.stack([eval_ids[i * stride : i * stride + n] for i in range(count)])


def proxy_loss(train_ids, eval_windows, cfg: ProxyConfig, lr: float, seed: int) -> float:
    """Train a fresh tiny LM on ``train_ids`` for ``cfg.steps`` and return its held-out loss."""
    import torch

    model, opt = build_proxy(cfg, seed)
    for group in opt.param_groups:
        group["lr"] = lr
    gen = torch.Generator().manual_seed(seed)
    span = len(train_ids) - cfg.seq_len - 1
    if span <= 0:
        raise ValueError(f"a dataset has {len(train_ids)} characters; need more than seq_len={cfg.seq_len}")
    for _ in range(cfg.steps):
        starts = torch.randint(0, span, (cfg.batch_size,), generator=gen)
        train_step(model, opt, torch.stack([train_ids[s : s + cfg.seq_len + 1] for s in starts.tolist()]))
    return held_out_loss(model, eval_windows)


def compare(cfg: ProxyConfig, progress: bool = True) -> dict:
    """Held-out loss per dataset, learning rate and seed; the ranking at each rate with its spread."""
    import torch

    from tidal.models import tiny

    if len(cfg.datasets) < 2 or not cfg.eval:
        from tidal.config import ConfigError

        raise ConfigError("compare needs proxy.datasets=[A, B, ...] (two or more) and proxy.eval=PATH")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tokenizer = tiny.build_tokenizer()
    eval_windows = windows(_encode(tokenizer, _texts(cfg.eval, cfg.text_key)), cfg, cfg.eval)
    train = {path: _encode(tokenizer, _texts(path, cfg.text_key)) for path in cfg.datasets}
    rates = [cfg.lr, *cfg.compare_lrs]
    runs = [(lr, path, seed) for lr in rates for path in cfg.datasets for seed in cfg.seeds]
    losses: dict[float, dict[str, list[float]]] = {lr: {p: [] for p in cfg.datasets} for lr in rates}
    for lr, path, seed in progress_bar(progress, iterable=runs, desc="proxy models"):
        losses[lr][path].append(proxy_loss(train[path], eval_windows, cfg, lr, seed))
    by_rate = []
    for lr in rates:
        rows = [{"dataset": p, "mean_loss": statistics.fmean(v), "std_loss": statistics.pstdev(v), "losses": v}
                for p, v in losses[lr].items()]
        rows.sort(key=lambda r: r["mean_loss"])
        per_seed = [tuple(sorted(cfg.datasets, key=lambda p: losses[lr][p][k])) for k in range(len(cfg.seeds))]
        by_rate.append({"lr": lr, "ranking": [r["dataset"] for r in rows], "rows": rows,
                        "seeds_agreeing_with_ranking": sum(list(s) == [r["dataset"] for r in rows] for s in per_seed),
                        "seeds": len(cfg.seeds)})
    flips = len({tuple(r["ranking"]) for r in by_rate}) > 1
    return {"by_lr": by_rate, "ranking": by_rate[0]["ranking"], "ranking_depends_on_lr": flips,
            "characters": {p: int(len(t)) for p, t in train.items()}}


def main_compare(overrides: list[str], out: str | Path, progress: bool = True, overwrite: bool = False) -> dict:
    """Check the config, then ``out`` (never a folder, an input, or an existing file without ``overwrite``:
    ``utils/outputs.py``) before the search; write the report to ``out`` whole."""
    import json

    from tidal.config import apply_overrides
    from tidal.utils.files import replace_text
    from tidal.utils.outputs import claim_file

    cfg = apply_overrides(ProxyConfig(), [o.removeprefix("proxy.") for o in overrides])
    inputs = {"proxy.eval": cfg.eval, **{f"proxy.datasets[{i}]": p for i, p in enumerate(cfg.datasets)}}
    claim_file(out, inputs, overwrite)
    result = compare(cfg, progress)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    replace_text(out, json.dumps(result, indent=2))
    return result
