"""A full disk (writes past a few bytes fail with EFBIG) is an error naming the file, and never tears a file
the run already had."""

import resource
import signal
from contextlib import contextmanager

import pytest

from tidal.config import save_yaml
from tidal.system.config import RunConfig
from tidal.utils.metrics import JsonlTracker


@contextmanager
def disk_full_at(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_saving_a_config_on_a_full_disk_keeps_the_old_file(tmp_path):
    path = tmp_path / "config.yaml"
    save_yaml(RunConfig(), path)
    before = path.read_text()
    with disk_full_at(100), pytest.raises(OSError, match=f"could not write {path}: File too large"):
        save_yaml(RunConfig(max_steps=7), path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_metrics_row_that_cannot_be_written_names_the_file(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log(0, {"eval/accuracy": 0.5})
    with disk_full_at(100), pytest.raises(OSError, match="could not write .*metrics.jsonl: File too large"):
        tracker.log(1, {f"reward/k{i}": 1.0 for i in range(20)})
    tracker.close()


def test_resuming_on_a_full_disk_keeps_the_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(f'{{"step": {i}, "reward/mean": 0.{i}}}\n' for i in range(10))
    path.write_text(rows)
    with disk_full_at(50), pytest.raises(OSError, match=f"could not write {path}"):
        JsonlTracker(path, resume_after_step=5)
    assert path.read_text() == rows and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    JsonlTracker(path, resume_after_step=5).close()
    assert path.read_text() == rows[: rows.index('{"step": 6')]
