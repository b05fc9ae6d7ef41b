"""datatrove's side of ``tidal bench curate``: run in the benchmark's own venv (datatrove is no tidal
dependency). Times, on one worker, (1) datatrove's full MinHash dedup (its four stages:
signatures, buckets, clusters, filter) with FineWeb's settings (5-grams, 14 buckets x 8 hashes), and
(2) its Gopher quality filter, each from reading the JSONL to writing the kept rows. Prints JSON.

    python benchmarks/curate_datatrove.py CORPUS.jsonl WORKDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(corpus: str, work: str) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import GopherQualityFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    work = Path(work)
    src = Path(corpus)
    n = sum(1 for _ in src.open())
    reader = lambda: JsonlReader(str(src.parent), glob_pattern=src.name, text_key="text", id_key="id")  # noqa: E731
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)

    def run(name, pipeline, tasks=1):
        t = time.perf_counter()
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(work / "logs" / name)).run()
        return time.perf_counter() - t

    out = {"docs": n}
    stages = {
        "signatures": [reader(), MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg)],
        "buckets": [MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"),
                                        config=cfg)],
        "clusters": [MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"),
                                         config=cfg)],
        "filter": [reader(), MinhashDedupFilter(input_folder=str(work / "remove")),
                   JsonlWriter(str(work / "deduped"))],
    }
    # the buckets stage runs one task per bucket (datatrove requires tasks divisible by num_buckets),
    # still one worker: the same single core
    out["minhash_stage_s"] = {name: run(f"minhash_{name}", p, cfg.num_buckets if name == "buckets" else 1)
                              for name, p in stages.items()}
    out["minhash_s"] = sum(out["minhash_stage_s"].values())
    out["minhash_kept"] = sum(1 for f in (work / "deduped").glob("*.jsonl*") for _ in _lines(f))
    out["gopher_s"] = run("gopher", [reader(), GopherQualityFilter(), JsonlWriter(str(work / "gopher"))])
    return out


def _lines(path: Path):
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        yield from f


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
