"""A run's files: written so that a failure never leaves a torn one, read so that a torn line costs only itself."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path, valid: Callable[[Any], bool]) -> tuple[list, int]:
    """The parsed lines of a JSONL file that pass ``valid``, and how many lines were skipped: not JSON (a
    line torn by a crash) or not ``valid``. Blank lines are ignored; undecodable bytes become U+FFFD."""
    rows, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if valid(row):
                rows.append(row)
            else:
                skipped += 1
    return rows, skipped


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name, then rename it over ``path``: a full disk or a
    Ctrl-C leaves the previous file whole. An OSError names the file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"could not write {path}: {e.strerror}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
