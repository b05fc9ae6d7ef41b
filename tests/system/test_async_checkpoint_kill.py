"""``kill -9`` in the middle of a background checkpoint write: the newest complete checkpoint is the one
``--resume`` finds, its hashes check, and the resumed run is exactly the uninterrupted one.

A real ``tidal train`` process (sync mode: exactly reproducible) writes checkpoints in the background
(``async_checkpoint``, the default). ``TIDAL_TEST_HOLD_CHECKPOINT_WRITE`` holds the write of ``step_4`` after
its weights are written and before its trainer state, hashes and rename (``train/checkpoint.py``), and says
so in a marker file: the kill lands mid-write every time, not by timing luck."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tidal.train.checkpoint import WRITE_HOLD_ENV, latest_checkpoint, verify_hashes

TIMEOUT_S = 180
TINY = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
    "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=16",
    "reward.name=digit_match", "reward.num_workers=0", "rollout.group_size=4", "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4", "max_steps=6", "max_time_s=null", "target_accuracy=null", "eval_every=2",
    "num_eval=16", "checkpoint_every=2", "keep_checkpoints=1", "optim.lr=1e-2", "system.num_threads=1",
    "system.mode=sync", "log.progress=false", "log.tensorboard=false", "log.report=false"]
COMPARABLE = ("reward/", "algo/", "train/", "eval/", "rollout/response", "async/staleness")


def _start(out: Path, cache: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    sets = [a for s in [*TINY, f"sft.cache_dir={cache}"] for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "tidal.cli", "train", "quickstart_grpo", "--out", str(out), *sets,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})},
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> None:
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(COMPARABLE)} for r in rows]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The warm-start cache: the first run below (the uninterrupted one) trains the tiny base into it, the later
    ones load it. No separate warm-up process: a base trained in the run or loaded from the cache gives the run
    the same weights and random state (the warm start's init forks the RNG and its data order has its own
    generator; the run seeds everything before it), measured: a fresh and a cached run's metrics, step_6 weights
    and RNG states are equal."""
    return tmp_path_factory.mktemp("cache")


def test_kill_9_mid_write_leaves_the_previous_checkpoint_and_resume_is_exact(tmp_path, cache):
    full = tmp_path / "full"
    _finish(_start(full, cache))  # trains the base into the cache: the killed run and its resume load it
    assert len(list(cache.glob("base-*"))) == 1

    out, marker = tmp_path / "killed", tmp_path / "holding"
    proc = _start(out, cache, env={WRITE_HOLD_ENV: f"4:{marker}"})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the write of step_4 never started: {proc.poll()} {proc.stderr.read()[-2000:]}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    root = out / "checkpoints"
    # killed mid-write: step_4's weights on disk in its temporary directory, nothing after them
    assert (root / ".tmp_step_4" / "model.safetensors").exists()
    assert not (root / ".tmp_step_4" / "trainer_state.pt").exists() and not (root / "step_4").exists()
    # keep_checkpoints=1: step_2, the newest complete one, was kept while step_4 was in flight, and checks
    assert (root / "latest").read_text() == "step_2" and latest_checkpoint(root) == root / "step_2"
    assert verify_hashes(root / "step_2") == 2
    assert max(r["step"] for r in _rows(out)) >= 4  # training went on past step_4 while it was being written

    _finish(_start(out, cache, "--resume"))
    assert _rows(out) == _rows(full)
    assert not list(root.glob(".tmp_*")) and sorted(p.name for p in root.iterdir()) == ["latest", "step_6"]
    mine, theirs = root / "step_6", full / "checkpoints" / "step_6"
    assert (mine / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    a, b = (torch.load(d / "trainer_state.pt", weights_only=False) for d in (mine, theirs))
    for blob in (a, b):
        del blob["state"]["extra"]["elapsed_s"]  # wall time: the one thing that differs
    assert a["state"] == b["state"] and a["scheduler"] == b["scheduler"]
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert all(torch.equal(a["optimizer"]["state"][i][k], v) for i, s in b["optimizer"]["state"].items()
               for k, v in s.items())
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
