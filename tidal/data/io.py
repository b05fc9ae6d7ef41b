"""Read and write rows: JSONL (optionally .gz), Parquet, and Hugging Face datasets saved with
``save_to_disk``. Rows are plain dicts and come out exactly as they went in."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

Row = dict[str, Any]


class BadRows:
    """Lines of the input that are not JSON objects: skipped, counted, the first few kept for the report."""

    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(where)


def _kind(path: Path) -> str:
    name = path.name
    if path.is_dir():
        return "hf_disk"
    for suffix, kind in ((".jsonl.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json.gz", "jsonl.gz"),
                         (".parquet", "parquet")):
        if name.endswith(suffix):
            return kind
    raise ValueError(f"{path}: unknown format; use .jsonl, .jsonl.gz, .parquet or a Hugging Face dataset "
                     f"directory (save_to_disk)")


def read_rows(path: str | Path, bad: BadRows | None = None) -> Iterator[Row]:
    """Stream the rows of ``path``. A JSONL line that is not a JSON object is skipped and counted in
    ``bad`` (a curation run over millions of lines should not die on one)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    kind = _kind(path)
    if kind.startswith("jsonl"):
        opener = gzip.open if kind.endswith("gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row, err = None, str(e)
                if not isinstance(row, dict):
                    if bad is None:
                        why = err if row is None else type(row).__name__
                        raise ValueError(f"{path}:{lineno}: not a JSON object ({why})")
                    bad.add(f"{path}:{lineno}")
                    continue
                yield row
    elif kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
    else:
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: its splits one after another
            for split in ds:
                yield from ds[split]
        else:
            yield from ds


def write_rows(path: str | Path, rows: Iterable[Row]) -> int:
    """Write rows to ``path`` (format from its suffix; written to a temporary name, then renamed, so a
    crash never leaves a half file under the real name). Returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = "hf_disk" if path.suffix == "" else _kind(path)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    if kind.startswith("jsonl"):
        opener = gzip.open if kind.endswith("gz") else open
        with opener(tmp, "wt", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table_rows = list(rows)
        n = len(table_rows)
        pq.write_table(pa.Table.from_pylist(table_rows), tmp)
    else:
        import shutil

        from datasets import Dataset

        table_rows = list(rows)
        n = len(table_rows)
        Dataset.from_list(table_rows).save_to_disk(str(tmp))
        if path.exists():
            shutil.rmtree(path)
    tmp.rename(path)
    return n
