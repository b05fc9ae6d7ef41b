"""``bash scripts/device_check.sh --dry-run``: the device check's stages on a CPU with tiny shapes, each stage's JSON
written before the next starts, so a stage that runs past its time limit loses only its own record (issue 51).

The default suite runs the cheapest stages and a time-out (about 10 s); the whole dry run (every stage, about
45 s on 2 shared cores) is slow-marked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(out: Path, *stages: str, **limits: int) -> str:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           **{k: str(v) for k, v in limits.items()}}
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", *stages], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_timed_out_stage_loses_only_its_own_record(tmp_path):
    log = dry_run(tmp_path, "bench", "env", "trl", BENCH_LIMIT=2)
    assert "DRY RUN on the CPU" in log and "=== summary (DRY RUN" in log
    bench = json.loads((tmp_path / "stage_bench.json").read_text())
    assert bench["timed_out"] is True and bench["rc"] == 124 and bench["limit_s"] == 2 and bench["dry_run"] is True
    assert not (tmp_path / "gpu.json").exists()  # the bench never finished
    for name in ("env", "trl"):  # the stages after it ran and wrote their records
        stage = json.loads((tmp_path / f"stage_{name}.json").read_text())
        assert stage["rc"] == 0 and stage["timed_out"] is False and stage["limit_s"] == 120, stage
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert summary["dry_run"] is True and [s["stage"] for s in summary["stages"]] == ["bench", "env", "trl"]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["cuda_available"] is False  # the dry run hides any GPU


def test_the_default_check_fits_eight_minutes():
    """Issue 51: the default stages' limits sum to at most 8 minutes on any machine (a 15-minute loan holds the
    machine's start and one rerun), and the bench stage hands the bench a budget inside its own limit."""
    import re

    script = (ROOT / "scripts" / "device_check.sh").read_text()
    default = re.search(r"else stages=\(([^)]*)\); fi", script).group(1).split()
    assert default == ["env", "tests", "bench"]
    limits = {name: int(seconds) for name, seconds in re.findall(r"limit (\w+) (\d+)\)", script)}
    assert sum(limits[name] for name in default) <= 8 * 60, limits
    assert "budget_s=$((bench_limit > 60 ? bench_limit - 30" in script


@pytest.mark.slow
def test_the_whole_dry_run(tmp_path):
    dry_run(tmp_path)
    summary = json.loads((tmp_path / "device_check.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["env", "tests", "cpu", "bench", "arms", "trl", "smollm2", "moe"]
    assert all(s["rc"] == 0 and not s["timed_out"] for s in stages.values()), stages
    gpu = json.loads((tmp_path / "gpu.json").read_text())
    assert gpu["on_cpu"] is True and gpu["tiny"] is True and "stand-in" in gpu["model"]
    assert set(gpu["trainer_phase_ms"]) == {"forward", "head", "backward", "optimizer"}
    assert gpu["decode_step_ms"] > 0 and gpu["rl_samples_per_s"] > 0 and gpu["rl_response_lengths"]["count"] == 6
    assert "profile" in gpu["train"]  # the device check's --set profile=true ran too
    arms = json.loads((tmp_path / "arms" / "gpu.json").read_text())
    want = {"decode_step_ms_repeat", "decode_step_ms_gqa", "decode_step_ms_fold", "trainer_mfu_bf16_master",
            "head_kernel_speedup", "decode_step_ms_by_host_reads"}
    assert want <= set(arms)
    moe = json.loads((tmp_path / "moe.json").read_text())
    assert moe["arms"] == ["off", "r3"] and 0 < moe["routing_agreement_off"] <= 1
