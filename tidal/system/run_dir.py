"""The run directory (``tidal train --out DIR``): never lose a previous run's data by accident.

A new run refuses a directory that already holds a run's data (``metrics.jsonl``, ``journal.jsonl``
or a checkpoint) unless ``--resume`` continues it or ``--overwrite`` deletes it first; an unusable
``--out`` (a file, a read-only place) is one line before any work. A ``checkpoints/`` directory that
holds only a ``.tmp_*`` leftover of a failed save has no checkpoint: such a run cannot be resumed,
and ``--overwrite`` starts it again.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

from tidal.config import ConfigError
from tidal.train.checkpoint import latest_checkpoint
from tidal.utils.runs import RUN_DATA

RUN_OUTPUTS = (*RUN_DATA, "report.html", "inspect.html")
"""Everything ``tidal train`` writes into its directory (what ``--overwrite`` removes; nothing else is touched)."""


class RunDirError(ConfigError):
    """``--out`` cannot take this run (printed as one line by the CLI)."""


def previous_run(out: Path) -> list[str]:
    """The files in ``out`` that hold a previous run's data, as the user would name them."""
    found = [name for name in ("metrics.jsonl", "journal.jsonl")
             if (out / name).is_file() and (out / name).stat().st_size > 0]
    ckpt = latest_checkpoint(out / "checkpoints")
    return found + ([f"checkpoints/{ckpt.name}"] if ckpt is not None else [])


def _usable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise RunDirError(f"--out {out}: cannot write a run there ({e.strerror or e})") from None


def prepare_out_dir(out: Path, resume: bool, overwrite: bool) -> str | None:
    """Check ``out`` can take the run; with ``overwrite``, delete the previous run's files. Returns the
    line to print about what was deleted (None if nothing was)."""
    if resume and overwrite:
        raise RunDirError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    if resume and not out.exists():
        raise RunDirError(f"--resume: {out} does not exist, so there is no run to continue")
    _usable(out)
    if resume:
        return None
    found = previous_run(out)
    if found and not overwrite:
        if any(f.startswith("checkpoints/") for f in found):
            raise RunDirError(f"{out} already holds a run ({', '.join(found)}); pass --resume to continue it, "
                              "--overwrite to delete it and start again, or choose another --out")
        raise RunDirError(f"{out} holds a previous run's {', '.join(found)} but no checkpoint to resume; pass "
                          "--overwrite to delete it and start again, or choose another --out")
    if not overwrite:
        return None
    removed = [name for name in RUN_OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
    if not removed:
        return None
    names = [f"{name}/" if (out / name).is_dir() else name for name in removed]
    for name in removed:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return f"--overwrite: deleted the previous run's {', '.join(names)} from {out}"


def interrupted_message(out: Path, recipe: str) -> str:
    """One line after Ctrl-C: where the last checkpoint is and the exact command that continues from it."""
    ckpt = latest_checkpoint(out / "checkpoints")
    base = f"tidal train {shlex.quote(recipe)} --out {shlex.quote(str(out))}"
    if ckpt is None:
        return f"interrupted before the first checkpoint; start again with: {base} --overwrite"
    return f"interrupted; checkpoint saved in {ckpt}; resume with: {base} --resume"
