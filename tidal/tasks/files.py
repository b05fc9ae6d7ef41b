"""Dataset adapters for local files: ``jsonl`` (plain or .gz), ``parquet`` and ``hf_disk``.

Each reads rows from ``task.path`` (a file, a directory of such files, or a glob), maps them to
prompts with ``task.fields`` / ``task.template`` (see ``rows.py``), and holds out an eval set
(``task.eval_path`` / ``task.eval_split``, else a hash split). Rows are numbered from 1 (for JSONL
the line number; blank lines are skipped but keep their number) so a warning about a bad row points
at the line to fix. Rows may show images (``task.fields.images``, content-part prompts, ``rows.py``);
relative image paths name files beside the data file (for hf_disk: in or beside ``task.path``).

``hf_disk`` reads Hugging Face ``datasets`` data without ever touching the hub: a
``save_to_disk`` directory via ``load_from_disk``, or local data files via
``load_dataset(builder, data_files=...)``, with both libraries' offline switches turned on for the
duration of the load. A path that does not exist is an error, never a download.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.rows import BadRow, Loaded, RowTask, drop_overlap, numbered, parse_rows, split_eval

_NOT_LOCAL = ("hf://", "http://", "https://", "s3://", "gs://")


def resolve(path: str | None, suffixes: tuple[str, ...], key: str = "task.path") -> list[Path]:
    """The files a ``path`` names: itself, the matching files in a directory, or a glob's matches."""
    if not path:
        raise ConfigError(f"{key} is required for this task (a local file, directory or glob)")
    if path.startswith(_NOT_LOCAL):
        raise ConfigError(f"{key}={path!r}: only local files are read; tidal never downloads datasets")
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(suffixes))
    else:
        files = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
    if not files:
        raise FileNotFoundError(f"{key}={path!r}: no {'/'.join(suffixes)} files there "
                                "(tidal reads local files only and never downloads datasets)")
    return files


def _label(files: list[Path], f: Path) -> str:
    return f"{f.name}:" if len(files) > 1 else ""


def read_jsonl(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(line label, parsed object or a BadRow if the line is not UTF-8 or not JSON) per non-blank line;
    gzip by magic bytes. Lines are read as bytes and decoded one by one: a stray byte costs its line."""
    for f in files:
        with open(f, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
        with (gzip.open(f, "rb") if gz else open(f, "rb")) as fh:
            try:
                for n, line in enumerate(fh, start=1):
                    if line.strip():
                        yield f"{_label(files, f)}{n}", _decode(line)
            except (gzip.BadGzipFile, EOFError) as e:
                raise ConfigError(f"{f}: not a readable gzip file ({e})") from None


def _decode(line: bytes) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(None, f"not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(None, f"invalid JSON ({e.msg} at column {e.colno})")


def read_parquet(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Rows as Python dicts, a record batch at a time (a large file never sits in memory as objects)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in files:
        n = 0
        try:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{_label(files, f)}{n}", row
        except pa.ArrowException as e:
            raise ConfigError(f"{f}: not a readable Parquet file ({e})") from None


def per_file(reader: Callable[[list[Path]], Iterator[tuple[str, Any]]],
             files: list[Path]) -> Iterator[tuple[str, Any, Path]]:
    """``reader``'s labelled rows, each with its file's folder: relative image paths in a row name files
    beside the data file (so a dataset folder moves as a whole), wherever the run is started."""
    for f in files:
        for label, row in reader([f]):
            yield f"{_label(files, f)}{label}", row, f.parent


def _parse(rows: Iterator[tuple[str, Any, Path]], cfg: TaskConfig, source: str) -> Loaded:
    return parse_rows(rows, cfg.fields, cfg.template, source, max_images=cfg.max_images)


class _FileTask(RowTask):
    """Train rows from ``path``, eval rows from ``eval_path`` or a hash split of ``path``."""

    suffixes: tuple[str, ...] = ()
    reader: Callable[[list[Path]], Iterator[tuple[str, Any]]]

    def __init__(self, cfg: TaskConfig):
        source = f"task {self.name} ({cfg.path})"
        loaded = _parse(per_file(type(self).reader, resolve(cfg.path, self.suffixes)), cfg, source)
        if cfg.eval_path:
            eval_source = f"task {self.name} eval ({cfg.eval_path})"
            evals = _parse(per_file(type(self).reader, resolve(cfg.eval_path, self.suffixes, "task.eval_path")), cfg,
                           eval_source).prompts
            train = drop_overlap(loaded.prompts, evals, source, cfg)
        else:
            train, evals = split_eval(loaded.prompts, cfg, source)
        super().__init__(cfg, train, evals, skipped=len(loaded.skipped))


@TASKS.register("jsonl")
class JsonlTask(_FileTask):
    """One JSON object per line, plain or gzip-compressed."""

    name = "jsonl"
    suffixes = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
    reader = staticmethod(read_jsonl)


@TASKS.register("parquet")
class ParquetTask(_FileTask):
    """Parquet files (one or many shards)."""

    name = "parquet"
    suffixes = (".parquet",)
    reader = staticmethod(read_parquet)


_BUILDERS = {".jsonl": "json", ".json": "json", ".gz": "json", ".parquet": "parquet", ".csv": "csv",
             ".arrow": "arrow", ".txt": "text"}


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Switch ``datasets`` and ``huggingface_hub`` to offline mode for the block, then restore them."""
    import datasets.config as dc
    import huggingface_hub.constants as hc

    saved = (dc.HF_HUB_OFFLINE, dc.HF_DATASETS_OFFLINE, hc.HF_HUB_OFFLINE)
    dc.HF_HUB_OFFLINE = dc.HF_DATASETS_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dc.HF_HUB_OFFLINE, dc.HF_DATASETS_OFFLINE, hc.HF_HUB_OFFLINE = saved


def load_hf(path: str | None, params: dict[str, Any], key: str = "task.path"):
    """A ``datasets.Dataset`` or ``DatasetDict`` from a save_to_disk directory or local data files."""
    unknown = set(params) - {"builder", "cache_dir"}
    if unknown:
        raise ConfigError(f"task.params for hf_disk: unknown {sorted(unknown)} (known: builder, cache_dir)")
    import datasets
    import pyarrow as pa

    unreadable = (datasets.exceptions.DatasetGenerationError, pa.ArrowException, ValueError, OSError)
    if path and Path(path).expanduser().is_dir() and _is_saved(Path(path).expanduser()):
        try:
            with offline():
                return datasets.load_from_disk(str(Path(path).expanduser()))
        except unreadable as e:
            raise ConfigError(f"{key}={path!r}: not a readable saved dataset ({e})") from None
    files = resolve(path, tuple(_BUILDERS), key)
    builder = params.get("builder") or _BUILDERS.get(files[0].suffix)
    if builder is None:
        raise ConfigError(f"{key}={path!r}: cannot tell the format of {files[0].name}; set task.params.builder")
    try:
        with offline():
            return datasets.load_dataset(builder, data_files=[str(f) for f in files],
                                         cache_dir=params.get("cache_dir"))
    except unreadable as e:  # the generation error wraps the parser's: name that one
        cause = e.__cause__ or e.__context__ or e
        raise ConfigError(f"{key}={path!r}: {builder} files not readable ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0] if str(cause) else ''})") from None


def _folder(path: str | None) -> Path | None:
    """Where relative image paths in hf_disk rows resolve: the saved dataset's (or data files') folder."""
    if not path:
        return None
    p = Path(path).expanduser()
    return p if p.is_dir() else p.parent


def _is_saved(d: Path) -> bool:
    return (d / "dataset_dict.json").exists() or (d / "state.json").exists()


def _split(ds, split: str, source: str):
    if hasattr(ds, "keys"):  # a DatasetDict
        if split not in ds:
            raise ConfigError(f"{source}: no split {split!r} (splits: {', '.join(ds.keys())})")
        return ds[split]
    return ds


@TASKS.register("hf_disk")
class HFDiskTask(RowTask):
    """Hugging Face ``datasets`` data on local disk (see the module docstring)."""

    name = "hf_disk"

    def __init__(self, cfg: TaskConfig):
        source = f"task hf_disk ({cfg.path})"
        ds = load_hf(cfg.path, cfg.params)
        loaded = parse_rows(numbered(_split(ds, cfg.split, source)), cfg.fields, cfg.template, source,
                            max_images=cfg.max_images, folder=_folder(cfg.path))
        if cfg.eval_split or cfg.eval_path:
            eval_ds = ds if not cfg.eval_path else load_hf(cfg.eval_path, cfg.params, "task.eval_path")
            eval_source = f"task hf_disk eval ({cfg.eval_path or cfg.path}, split {cfg.eval_split or 'train'})"
            eval_rows = numbered(_split(eval_ds, cfg.eval_split or "train", eval_source))
            evals = parse_rows(eval_rows, cfg.fields, cfg.template, eval_source, max_images=cfg.max_images,
                               folder=_folder(cfg.eval_path or cfg.path)).prompts
            train = drop_overlap(loaded.prompts, evals, source, cfg)
        else:
            train, evals = split_eval(loaded.prompts, cfg, source)
        super().__init__(cfg, train, evals, skipped=len(loaded.skipped))
