"""Data-mixture search: grid ground truth vs merge, Aioli and Bayesian optimisation, on a synthetic corpus.

Four domains built here, as character text the tiny tokenizer covers:

- ``words``: sentences from a small fixed vocabulary and grammar;
- ``arith``: sums like ``37+45=82.``;
- ``code``: assignments like ``let q = (k * 7) - m;``;
- ``noise``: uniformly random characters (useless for the held-out set).

The held-out set is fresh rows (other seeds, so no row is shared with a domain) in unequal shares:
``eval_shares`` (words 0.5, arith 0.35, code 0.15, noise 0). So the best mixture is not uniform: noise
is wasted budget, and the other three are needed in different amounts.

Ground truth: ``tidal curate mixture``'s grid (every mixture in steps of 1/grid_resolution, at every
seed). Each method searches on the first seed; its chosen mixture is trained at every seed with the
same budget. Reported: ``regret_by_method`` ((loss - grid best) / grid best), ``compute_frac_by_method``
(search compute / the grid's, in proxy-step equivalents), ``best_method`` (lowest regret among the
methods at <= 20% of the grid's compute), ``goal_met_by``, and a uniform-mixture row for scale.
Aioli's regret is that of its final proportions trained like every other choice; its online run's
own loss (first seed) is ``aioli_online_run_loss`` / ``aioli_online_run_regret``.

    tidal bench mixture [--set budget=100 --set seeds=3 --set grid_resolution=4 ...]
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import apply_overrides

DESCRIPTION = "data-mixture search (grid vs merge vs Aioli vs Bayesian optimisation): regret and compute"

WORDS = ("the cat dog bird fish man girl boy old big small red blue green sees likes finds eats takes "
         "a one my your and but then with near under over happy sad quick slow").split()
NOISE = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=().,"


@dataclass
class Settings:
    rows: int = 150
    """Rows per domain (about 150 characters each)."""
    eval_rows: int = 60
    eval_shares: list[float] = field(default_factory=lambda: [0.5, 0.35, 0.15, 0.0])
    """Held-out shares of words, arith, code, noise."""
    budget: int = 100
    seeds: int = 3
    grid_resolution: int = 4
    mixture: list[str] = field(default_factory=list)
    """Extra ``tidal curate mixture`` overrides (e.g. ``bayes.trials=8``)."""
    seed: int = 0


def _sentence(rng: random.Random) -> str:
    subject = f"{rng.choice(['the', 'a', 'my', 'your'])} {rng.choice(WORDS[1:8])}"
    obj = f"{rng.choice(['the', 'a', 'one'])} {rng.choice(WORDS[8:15])} {rng.choice(WORDS[1:8])}"
    return f"{subject} {rng.choice(WORDS[15:19])} {obj} {rng.choice(WORDS[24:30])}."


def _row(domain: str, rng: random.Random, length: int = 150) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) + len(parts) < length:
        if domain == "words":
            parts.append(_sentence(rng))
        elif domain == "arith":
            a, b = rng.randrange(100), rng.randrange(100)
            parts.append(f"{a}+{b}={a + b}.")
        elif domain == "code":
            v = "abcdefghijklmnopqrstuvwxyz"
            parts.append(f"let {rng.choice(v)} = ({rng.choice(v)} {rng.choice('+-*')} {rng.randrange(10)}) "
                         f"{rng.choice('+-*')} {rng.choice(v)};")
        else:
            parts.append("".join(rng.choice(NOISE) for _ in range(30)))
    return " ".join(parts)


DOMAINS = ("words", "arith", "code", "noise")


def build_corpus(out: Path, s: Settings) -> tuple[list[str], str]:
    """Write one JSONL per domain and the held-out set; returns (domain paths, eval path)."""
    from tidal.data.io import write_rows

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, d in enumerate(DOMAINS):
        rng = random.Random(s.seed * 100 + i)
        write_rows(out / f"{d}.jsonl", [{"text": _row(d, rng)} for _ in range(s.rows)])
        paths.append(str(out / f"{d}.jsonl"))
    rng = random.Random(s.seed * 100 + 50)
    counts = [round(share * s.eval_rows) for share in s.eval_shares]
    rows = [{"text": _row(d, rng)} for d, c in zip(DOMAINS, counts) for _ in range(c)]
    rng.shuffle(rows)
    write_rows(out / "eval.jsonl", rows)
    return paths, str(out / "eval.jsonl")


def run(overrides: list[str], out_dir: Path) -> dict:
    import torch

    from tidal.data.mixture import MixtureConfig
    from tidal.data.mixture_methods import run_mixture

    s = apply_overrides(Settings(), overrides)
    torch.set_num_threads(1)  # a shared 2-core machine: one thread per proxy keeps runs comparable
    tmp = tempfile.TemporaryDirectory()  # the corpus is rebuilt from its seed; nothing to keep
    domains, eval_path = build_corpus(Path(tmp.name), s)
    cfg = apply_overrides(MixtureConfig(), [f"domains=[{', '.join(domains)}]", f"eval={eval_path}", "method=all",
                                            f"budget={s.budget}", f"seeds={list(range(s.seeds))}",
                                            f"grid_resolution={s.grid_resolution}",
                                            f"weights={[0.25] * len(DOMAINS)}", *s.mixture])
    start = time.perf_counter()
    report = run_mixture(cfg, progress=False)
    seconds = time.perf_counter() - start
    tmp.cleanup()
    online = report["methods"]["aioli"]["search"]["online_run_loss"]
    methods = report["methods"]
    table = [{"method": m, "mix": " ".join(f"{p:.2f}" for p in r["mix"].values()),
              "held_out_loss": r["held_out_loss"], "regret": report["regret_by_method"][m],
              "compute_frac": report["compute_frac_by_method"].get(m, float("nan")),
              "step_equivalents": r.get("compute", {}).get("step_equivalents", float("nan"))}
             for m, r in methods.items()]
    for row in table:
        if row["method"] == "given":
            row["method"] = "uniform"
    return {"table": table, "regret_by_method": {("uniform" if m == "given" else m): v
                                                 for m, v in report["regret_by_method"].items()},
            "compute_frac_by_method": report["compute_frac_by_method"], "best_method": report["best_method"],
            "goal": report["goal"], "goal_met_by": report["goal_met_by"],
            "grid_best_mix": methods["grid"]["mix"], "grid_best_loss": report["grid_best_loss"],
            "domains": list(DOMAINS), "eval_shares": s.eval_shares, "settings": vars(s) | {"mixture": s.mixture},
            "aioli_online_run_loss": online,
            "aioli_online_run_regret": (online - report["grid_best_loss"]) / report["grid_best_loss"],
            "seconds": seconds, "report": report}
