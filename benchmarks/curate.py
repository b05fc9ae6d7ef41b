"""tidal curate vs datatrove: documents per second per core for near-dedup and Gopher quality
filtering, side by side on the same synthetic corpus.

The corpus: ``docs`` prose-like documents of ``words`` words (``tests/data/corpus.py``'s generator),
with planted exact and near duplicates. Both run one worker, from reading the JSONL to writing the
kept rows: tidal's ``dedup`` recipe restricted to ``near_dedup`` and its ``gopher_quality`` block;
datatrove's full MinHash dedup (signatures, buckets, clusters, filter; FineWeb's 5-grams, 14 x 8)
and its ``GopherQualityFilter``, in the benchmark's own venv (``.tidal_cache/bench-datatrove-venv``,
``benchmarks/curate_datatrove.py``). Also reported: how many planted duplicates each dedup removed.
The issue's goal: tidal's near-dedup at 3,000+ documents/s per core.

    tidal bench curate [--set docs=5000 --set words=500]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.config import apply_overrides

DESCRIPTION = "tidal curate vs datatrove: near-dedup and Gopher-quality documents/s per core"
DATATROVE = ["datatrove==0.6.0", "orjson", "spacy", "xxhash<4"]
"""datatrove's extras: orjson for its JsonlReader, spaCy for its word tokenizer; xxhash 4 (tidal's env)
rejects the str its MinHash hashes."""


@dataclass
class Settings:
    docs: int = 5000
    words: int = 500
    duplicate_frac: float = 0.1
    datatrove: bool = True
    venv: str = ".tidal_cache/bench-datatrove-venv"


def _load(name: str):
    import importlib.util

    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"tidal_benchmark_{path.stem.lstrip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_corpus(s: Settings, path: Path) -> set[str]:
    """Write the corpus; return the ids of the planted copies."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.data.corpus import document, near_copy, vocabulary

    rng = random.Random(0)
    vocab = vocabulary(rng)
    n_copies = int(s.docs * s.duplicate_frac)
    originals = [document(rng, vocab, s.words) for _ in range(s.docs - n_copies)]
    rows = [{"id": f"doc{i}", "text": t} for i, t in enumerate(originals)]
    copies = [{"id": f"copy{j}", "text": near_copy(rng, rng.choice(originals), vocab)} for j in range(n_copies)]
    rows += copies
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {r["id"] for r in copies}


def _tidal(recipe: str, blocks: str, src: Path, out: Path) -> tuple[float, set[str]]:
    from tidal.data.curate import curate
    from tidal.data.io import read_rows

    t = time.perf_counter()
    curate(recipe, src, out, [f"blocks=[{blocks}]", "workers=1"], progress=False)
    return time.perf_counter() - t, {r["id"] for r in read_rows(out)}


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    work = out_dir / "curate"
    src = work / "corpus" / "corpus.jsonl"
    copies = make_corpus(s, src)
    all_ids = {f"doc{i}" for i in range(s.docs - len(copies))} | copies
    rows = []
    t_dedup, kept = _tidal("dedup", "near_dedup", src, work / "tidal_dedup.jsonl")
    removed = all_ids - kept
    rows.append({"framework": "tidal", "stage": "near-dedup", "docs_per_s": s.docs / t_dedup, "seconds": t_dedup,
                 "planted_removed": len(removed & copies) / len(copies), "others_removed": len(removed - copies)})
    t_gopher, kept = _tidal("quality", "gopher_quality", src, work / "tidal_gopher.jsonl")
    rows.append({"framework": "tidal", "stage": "gopher-quality", "docs_per_s": s.docs / t_gopher,
                 "seconds": t_gopher, "kept": len(kept)})
    if s.datatrove:
        python = _load("_venv.py").bench_venv(s.venv, DATATROVE, "curate")
        dt_work = work / "datatrove"
        proc = subprocess.run([str(python), str(Path(__file__).with_name("curate_datatrove.py")), str(src),
                               str(dt_work)], capture_output=True, text=True, check=True)
        dt = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append({"framework": "datatrove", "stage": "near-dedup", "docs_per_s": s.docs / dt["minhash_s"],
                     "seconds": dt["minhash_s"], "stages_s": dt["minhash_stage_s"],
                     "planted_removed": None, "kept": dt["minhash_kept"]})
        rows.append({"framework": "datatrove", "stage": "gopher-quality", "docs_per_s": s.docs / dt["gopher_s"],
                     "seconds": dt["gopher_s"]})
    by = {(r["framework"], r["stage"]): r["docs_per_s"] for r in rows}
    ratios = {stage: by[("tidal", stage)] / by[("datatrove", stage)]
              for stage in ("near-dedup", "gopher-quality") if ("datatrove", stage) in by}
    return {"benchmark": "curate", "description": DESCRIPTION, "table": rows, "tidal_over_datatrove": ratios,
            "goal_3000_docs_per_s": by[("tidal", "near-dedup")] >= 3000, "docs": s.docs, "words": s.words}
