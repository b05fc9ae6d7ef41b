"""Writing a run's files so that a failure never leaves a torn one."""

from __future__ import annotations

import os
from pathlib import Path


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
