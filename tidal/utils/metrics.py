"""Metric sinks: ``metrics.jsonl`` (the contract), TensorBoard, and W&B/MLflow when installed.

Each row is one JSON object: ``step`` first, then namespaced keys (``reward/mean``,
``eval/accuracy``, ``perf/gen_tokens_per_s``, ``async/staleness_mean`` ...). Rows are flushed as they
are written, so a crash loses at most the row being written; on resume, rows past the resumed step
are dropped first so the file never holds the same step twice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from tidal.utils.files import replace_text


def keep_steps_through(path: Path, step: int) -> None:
    """Rewrite the JSONL file ``path`` keeping only the rows whose ``step`` is <= ``step`` (a resume from
    the checkpoint at ``step``: the rows past it will be produced again). A torn or malformed row, left
    by the crash being resumed from, goes too. Written to a temporary file first, so a full disk never
    tears the run's history (``replace_text``)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a row torn by the crash we are resuming from
    replace_text(path, "".join(x + "\n" for x in kept))


def logged_rows(path: Path, through_step: int) -> list[dict]:
    """The rows of the JSONL file ``path`` whose ``step`` is <= ``through_step``, skipping a row torn by a
    crash (a resumed run's history up to its checkpoint). No file: no rows."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a row torn by the crash we resume from
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= through_step:
            rows.append(row)
    return rows


def last_logged_step(path: Path) -> int | None:
    """The step of the last row of the JSONL file ``path`` (None if there is none or it is torn). Read from
    the file because a Ctrl-C can land just after a row was written and before any bookkeeping about it."""
    lines = path.read_text().splitlines() if path.exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


class JsonlTracker:
    def __init__(self, path: str | Path, resume_after_step: int | None = None):
        self.path = Path(path)
        if resume_after_step is not None and self.path.exists():
            keep_steps_through(self.path, resume_after_step)
        elif resume_after_step is None and self.path.exists():
            self.path.unlink()
        self._f = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        try:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, f"could not write {self.path}: {e.strerror}") from e

    def close(self) -> None:
        self._f.close()


class TensorBoardTracker:
    """TensorBoard scalars. On resume, ``resume_after_step`` purges the steps past the checkpoint that an
    earlier event file already holds (``purge_step``), so TensorBoard shows each step once."""

    def __init__(self, log_dir: str | Path, resume_after_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_after_step is None else resume_after_step + 1
        self._w = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbTracker:
    def __init__(self, project: str, config: dict, run_dir: Path):
        import wandb  # optional extra: pip install 'tidal[wandb]'

        self._run = wandb.init(project=project, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    def __init__(self, experiment: str, config: dict):
        import mlflow  # optional extra: pip install 'tidal[mlflow]'

        self._mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run()
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(d: Mapping, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MultiTracker:
    """Fans each row out to several trackers."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
