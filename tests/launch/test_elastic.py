"""``tidal train RECIPE --set trainer.data_parallel=elastic``: the run's process leads replica processes it
starts itself. The slow test runs the real command with 2 replicas, kills replica 1 inside a step's forward
(``trainer.elastic.fault_step``), and checks that the leader redid the step alone, restarted the replica,
which healed and rejoined, and that the weights equal a 1-process run's within float rounding (sync mode
samples the same tokens from the same weights, and the elastic update is the 1-process update on any
number of replicas). The fast tests are the ConfigErrors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.system.test_controller import TINY_OVERRIDES
from tidal.cli import main
from tidal.config import ConfigError, apply_overrides
from tidal.recipes import RECIPES
from tidal.system.validate import validate_run_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*sets):
    return apply_overrides(RECIPES.get("quickstart_grpo")(), ["trainer.data_parallel=elastic", *sets])


@pytest.mark.parametrize("sets, names", [
    (["trainer.elastic.replicas=1"], "trainer.elastic.replicas"),
    (["trainer.elastic.timeout_s=0"], "trainer.elastic.timeout_s"),
    (["trainer.elastic.wait_ready_s=-1"], "trainer.elastic.wait_ready_s"),
    (["trainer.elastic.max_restarts=-1"], "trainer.elastic.max_restarts"),
    (["trainer.elastic.fault_step=0"], "trainer.elastic.fault_step"),
    (["trainer.elastic.host="], "trainer.elastic.host"),
    (["algo.advantage=gae"], "algo.advantage=gae"),
    (["sdc.replay_every=10"], "sdc.replay_every=10"),
    (["sdc.record=false", "sdc.rollback=false"], "sdc.record=False, sdc.rollback=False"),
])
def test_what_elastic_cannot_run_is_one_config_error_naming_the_key(sets, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        validate_run_config(_cfg(*sets))


def test_the_documented_defaults_validate_and_other_modes_ignore_elastic_keys():
    validate_run_config(_cfg("trainer.elastic.replicas=3"))
    validate_run_config(apply_overrides(RECIPES.get("quickstart")(), ["sdc.replay_every=10"]))  # not elastic
    with pytest.raises(ConfigError, match="fsdp, diloco or elastic"):
        validate_run_config(apply_overrides(RECIPES.get("quickstart")(), ["trainer.data_parallel=ring"]))


def test_elastic_under_torchrun_is_refused_before_any_process_group(tmp_path, monkeypatch):
    from tidal.launch import elastic as elastic_run
    from tidal.launch import torchrun as data_parallel

    with pytest.raises(ConfigError, match="without torchrun"):
        data_parallel.train(_cfg(), tmp_path)  # would otherwise wait for a process group
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="without torchrun"):
        elastic_run.train(_cfg(), tmp_path)
    assert not any(tmp_path.iterdir()), "refused before writing anything"


def _weights(out: Path, step: int) -> dict:
    return load_file(str(out / "checkpoints" / f"step_{step}" / "model.safetensors"))


@pytest.mark.slow  # a 1-process run, then the leader and three replica processes (~20 s alone on 2 cores)
def test_a_killed_replica_is_restarted_heals_and_the_run_matches_one_process(tmp_path):
    steps = 6
    settings = [*TINY_OVERRIDES(tmp_path), f"max_steps={steps}", f"checkpoint_every={steps}", "system.mode=sync",
                "rollout.max_staleness=0"]
    sets = [x for s in settings for x in ("--set", s)]
    one = tmp_path / "one"
    assert main(["train", "quickstart_grpo", "--out", str(one), *sets]) == 0

    el = tmp_path / "elastic"
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart_grpo", "--out", str(el), *sets,
           "--set", "trainer.data_parallel=elastic", "--set", "trainer.elastic.replicas=2",
           "--set", "trainer.elastic.fault_step=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RUST_LOG", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout)["steps"] == steps
    assert "elastic replica 1 exited (status 17): starting it again (restart 1)" in done.stderr
    assert "[INFO] [torchft" not in done.stderr  # torchft's per-quorum logging is kept to warnings

    rows = [json.loads(x) for x in (el / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "elastic/step" in r]
    assert len(trained) >= 3
    # the step replica 1 died in: redone by the leader alone on the smaller quorum
    killed = next(r for r in trained if r["elastic/failed_attempts"] >= 1)
    assert killed["elastic/participants"] == 1 and killed["elastic/restarts"] == 0
    assert killed["step"] >= 2
    last = trained[-1]
    assert last["elastic/restarts"] == 1 and last["elastic/replicas_alive"] == 2
    assert last["elastic/participants"] == 2, "the restarted replica rejoined"
    assert last["elastic/replica_mismatches"] == 0
    # the restarted process started at quorum step 0 behind the leader: it rejoined by healing (reports
    # arrive a step late, so the count is read from the last row)
    assert last["elastic/heals"] >= 1

    a, b = _weights(one, steps), _weights(el, steps)
    base = load_file(str(next((tmp_path / "cache").rglob("model.safetensors"))))
    moved = max(float((a[k] - base[k]).abs().max()) for k in a)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-3 and diff < 1e-3 * moved, f"elastic run off the 1-process run by {diff} (moved {moved})"
    from tests.test_metrics_doc import documented

    patterns = documented()
    assert not [k for r in rows for k in r if k != "step" and not any(p.match(k) for p in patterns)], \
        "every metric the elastic run logs is in docs/metrics.md"
    one_rows = {r["step"]: r for r in (json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines())}
    assert [r["reward/mean"] for r in rows if "reward/mean" in r] == \
        [one_rows[r["step"]]["reward/mean"] for r in rows if "reward/mean" in r], "same samples, step by step"

    # the leader is the single point of failure; --resume continues from its 1-process checkpoint, the
    # replicas starting from the same checkpoint (no start-up copy: they must agree bit for bit)
    again = [*cmd, "--resume", "--set", f"max_steps={steps + 2}", "--set", "trainer.elastic.fault_step=null"]
    done = subprocess.run(again, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = [json.loads(x) for x in (el / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["step"] == steps + 2
    resumed = [r for r in resumed if r["step"] > steps and "elastic/step" in r]
    assert resumed and all(r["elastic/participants"] == 2 and r["elastic/failed_attempts"] == 0
                           and r["elastic/restarts"] == 0 and r["elastic/replica_mismatches"] == 0 for r in resumed)
