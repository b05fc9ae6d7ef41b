"""Read and write rows: JSONL (optionally .gz), Parquet, and Hugging Face datasets saved with
``save_to_disk``. Rows are plain dicts and come out exactly as they went in."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tidal.utils.outputs import check_not_input as refuse_overwrite  # noqa: F401  (every command's rule)

Row = dict[str, Any]


class BadRows:
    """Input lines that are not UTF-8 or not JSON objects: skipped, counted, the first few kept for the
    report as ``file:line: why`` (lines are numbered from 1, as an editor does)."""

    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(where)


def parse_line(raw: bytes) -> tuple[Any, str | None]:
    """One JSONL line as (a JSON object, None) or (None, why not); decoded on its own, so one bad byte
    costs one line, not the file."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
        return None, f"not a JSON object ({type(row).__name__})"
    return row, None


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


def input_kind(path: Path) -> str:
    """The format of an input (an error if it is missing or of no known format)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return _kind(path)


def output_kind(path: Path) -> str:
    """The format ``write_rows`` will write ``path`` in; an error, before any work, if it cannot."""
    kind = "hf_disk" if path.suffix == "" else _kind(path)
    if kind == "hf_disk" and path.exists() and not _is_saved_dataset(path):
        raise ValueError(f"{path}: exists and is not a Hugging Face dataset directory; refusing to replace it")
    if kind != "hf_disk" and path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; --out names the output file")
    return kind


def read_rows(path: str | Path, bad: BadRows | None = None) -> Iterator[Row]:
    """Stream the rows of ``path`` (see ``read_numbered``)."""
    for _, row in read_numbered(path, bad):
        yield row


def read_numbered(path: str | Path, bad: BadRows | None = None) -> Iterator[tuple[int, Row]]:
    """Stream ``(number, row)`` for ``path``: the 1-based line number in JSONL (blank lines keep their
    number), the 1-based row number otherwise. A JSONL line that is not UTF-8 or not a JSON object is
    skipped and counted in ``bad`` (a curation run over millions of lines should not die on one);
    without ``bad`` it is an error naming the line."""
    path = Path(path)
    kind = input_kind(path)
    if kind.startswith("jsonl"):
        opener = gzip.open if kind.endswith("gz") else open
        with opener(path, "rb") as f:
            try:
                for lineno, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    row, why = parse_line(raw)
                    if why is None:
                        yield lineno, row
                    elif bad is None:
                        raise ValueError(f"{path}:{lineno}: {why}")
                    else:
                        bad.add(f"{path}:{lineno}: {why}")
            except (gzip.BadGzipFile, EOFError) as e:
                raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
            n = 0
            for batch in batches:
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except pa.ArrowException as e:
            raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    else:
        from datasets import load_from_disk

        try:
            ds = load_from_disk(str(path))
        except FileNotFoundError as e:
            raise ValueError(f"{path}: not a Hugging Face dataset directory (save_to_disk): {e}") from None
        splits = [ds[split] for split in ds] if hasattr(ds, "keys") else [ds]  # a DatasetDict: one after another
        n = 0
        for split in splits:
            for row in split:
                n += 1
                yield n, row


def write_rows(path: str | Path, rows: Iterable[Row]) -> int:
    """Write rows to ``path`` (format from its suffix; no suffix: a Hugging Face dataset directory).
    They go to a temporary name that is renamed over ``path`` only once every row is written, so a
    failure (a bad row upstream, Ctrl-C, a full disk) leaves ``path`` as it was and no temporary file
    behind. Returns the number written."""
    path = Path(path)
    kind = output_kind(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        n = _write(kind, tmp, rows)
        if kind == "hf_disk" and path.exists():  # swap directories: the old one goes only once the new is in place
            old = path.with_name(path.name + ".old")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.replace(path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
    return n


def _is_saved_dataset(d: Path) -> bool:
    return d.is_dir() and ((d / "dataset_dict.json").exists() or (d / "state.json").exists())


def _write(kind: str, tmp: Path, rows: Iterable[Row]) -> int:
    n = 0
    if kind.startswith("jsonl"):
        opener = gzip.open if kind.endswith("gz") else open
        with opener(tmp, "wt", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
        return n
    table_rows = list(rows)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(table_rows), tmp)
    else:
        from datasets import Dataset

        Dataset.from_list(table_rows).save_to_disk(str(tmp))
    return len(table_rows)
