"""The run directory (``tidal train --out DIR``): never lose a previous run's data by accident.

The rule is every command's (``utils/outputs.py``): a new run refuses a directory that already holds a
run's data (``metrics.jsonl``, ``journal.jsonl`` or a checkpoint) unless ``--resume`` continues it or
``--overwrite`` deletes the files the previous run wrote (and only those: a user's file inside
``checkpoints/`` stays); an unusable ``--out`` (a file, a read-only place), an input the overwrite would
delete (``model.path=OUT/checkpoints/step_2``) and a second process on the same ``--out`` are one line
before any work. A ``checkpoints/`` directory that holds only a ``.tmp_*`` leftover of a failed save has
no checkpoint: such a run cannot be resumed, and ``--overwrite`` starts it again.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

from tidal.train.checkpoint import latest_checkpoint
from tidal.utils.outputs import Layout, RunDir
from tidal.utils.runs import RUN_DATA

RUN_OUTPUTS = (*RUN_DATA, "sdc", "report.html", "inspect.html")
"""Everything ``tidal train`` writes into its directory (``--overwrite`` deletes what it wrote under these names)."""

TRAIN = Layout("train", RUN_OUTPUTS, ("metrics.jsonl", "journal.jsonl"))


def open_out_dir(out: Path, resume: bool, overwrite: bool, inputs: Mapping[str, str | Path],
                 log: Callable[[str], None]) -> RunDir:
    """``out`` checked, locked and (with ``overwrite``) cleared of the previous run's files, for a run whose
    ``inputs`` (``{key: path}``) were checked already; close it when the run ends."""
    return RunDir.open(out, TRAIN, resume=resume, overwrite=overwrite, inputs=inputs,
                       checkpoint=lambda d: latest_checkpoint(d / "checkpoints"), log=log)


def interrupted_message(out: Path, recipe: str) -> str:
    """One line after Ctrl-C: where the last checkpoint is and the exact command that continues from it."""
    ckpt = latest_checkpoint(out / "checkpoints")
    base = f"tidal train {shlex.quote(recipe)} --out {shlex.quote(str(out))}"
    if ckpt is None:
        return f"interrupted before the first checkpoint; start again with: {base} --overwrite"
    return f"interrupted; checkpoint saved in {ckpt}; resume with: {base} --resume"
