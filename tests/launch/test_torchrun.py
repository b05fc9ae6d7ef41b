"""``torchrun --nproc_per_node 2 -m tidal.cli train``: the data-parallel run trains like one process,
checkpoints, and resumes (slow: two torchrun launches plus a 1-process run, ~1-2 minutes on 2 cores)."""

import json
import os
import subprocess
import sys

import pytest

from tests.system.test_controller import TINY_OVERRIDES
from tidal.cli import main
from tidal.models import tiny


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tidal.cli", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_two_process_run_matches_one_and_resumes(tmp_path):
    settings = [*TINY_OVERRIDES(tmp_path), "model.num_layers=2", "max_steps=2", "checkpoint_every=1",
                "rollout.prompts_per_step=6", "system.mode=sync", "rollout.max_staleness=0"]
    sets = [x for s in settings for x in ("--set", s)]

    one = tmp_path / "one"
    assert main(["train", "quickstart_grpo", "--out", str(one), *sets]) == 0
    two = tmp_path / "two"
    done = _torchrun("quickstart_grpo", "--out", str(two), *sets)
    assert done.stdout.count('"steps": 2') == 1  # rank 0 alone reports

    # sync mode samples the same tokens from the same weights: step 1 trains on the same batch
    first_one, first_two = (next(r for r in _rows(d) if r["step"] == 1) for d in (one, two))
    assert first_two["reward/mean"] == first_one["reward/mean"]
    assert first_two["train/loss"] == pytest.approx(first_one["train/loss"], rel=1e-4, abs=1e-6)
    assert first_two["train/grad_norm"] == pytest.approx(first_one["train/grad_norm"], rel=1e-4)
    assert first_one["train/grad_norm"] > 0  # a real update, not an all-zero-advantage batch
    assert sorted(p.name for p in (two / "checkpoints").glob("step_*")) == ["step_1", "step_2"]

    _torchrun("quickstart_grpo", "--out", str(two), "--resume", "--set", "max_steps=3")
    assert [r["step"] for r in _rows(two) if "train/loss" in r] == [1, 2, 3]
    tiny.load(two / "checkpoints" / "step_3")  # an ordinary Hugging Face directory
