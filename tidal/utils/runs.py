"""Several runs side by side: a short name for each, and which config keys differ between them; which
files in a run directory are its data.

An ablation is two runs, and its meaning is their config diff. Each run's ``config.yaml`` is flattened
to dotted keys (``rollout.max_staleness``), the way ``--set`` names them; a key is in the diff when its
value differs between the runs or is missing from some.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

MISSING = "(missing)"
RUN_DATA = ("config.yaml", "metrics.jsonl", "journal.jsonl", "checkpoints", "tensorboard", "samples.jsonl")
"""The files ``tidal train`` writes into its directory that hold the run's data (its pages, ``report.html``
and ``inspect.html``, are made from them): no command's ``--out`` may replace one."""


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """A short name per run: its directory's name, with the parent's when two runs share one."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}``; lists and scalars are values."""
    if not isinstance(tree, Mapping):
        return {prefix.rstrip("."): tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_config(run_dir: str | Path) -> tuple[str | None, dict[str, Any], str | None]:
    """(text, flattened keys, problem) of ``run_dir/config.yaml``: text None when there is no file; a file
    that is not a YAML mapping gives no keys and a one-line problem (shown, never raised: the metrics
    and samples are still worth seeing)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None, {}, None
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return text, {}, f"{path}: not valid YAML ({' '.join(str(e).split())})"
    if not isinstance(tree, Mapping):
        return text, {}, f"{path}: not a YAML mapping"
    return text, flatten(tree), None


def config_diff(configs: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(key, [each run's value, or MISSING]) for every key whose values are not all equal, sorted by key."""
    keys = sorted(set().union(*configs)) if configs else []
    rows = []
    for key in keys:
        values = [c.get(key, MISSING) for c in configs]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, values))
    return rows
