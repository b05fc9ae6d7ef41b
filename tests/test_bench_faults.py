"""``tidal bench faults`` as docs/faults.md runs it (a toy size): the issue's top-level keys, every flip of
the full-replay policy found at its step, phase and layer, and an elastic run that survives a kill."""

import re
from pathlib import Path

import pytest

from tidal import bench

pytest.importorskip("torchft", reason="torchft not installed (pip install -e '.[dev]')")

DOC = Path(__file__).resolve().parent.parent / "docs" / "faults.md"


@pytest.mark.slow
def test_bench_faults_as_documented(tmp_path):
    [command] = re.findall(r"^tidal bench faults (.*)$", DOC.read_text(), flags=re.M)
    overrides = re.findall(r"--set (\S+)", command)
    result = bench.load("faults").run(overrides, tmp_path)
    assert {"detection_rate", "localization_rate", "overhead_frac"} <= set(result)
    full = result["table"][0]
    assert full["injected"] == full["planned"] == 4  # every planned flip fired (at the next step that trains)
    assert full["result_changing"]["injected"] + full["benign"]["injected"] == 4 and full["unclassified"] == 0
    assert result["detection_rate"] == 1.0 and result["localization_rate"] == 1.0, result["faults"]
    assert full["detection_rate"] == 1.0  # the full replay also finds the flips that change nothing
    assert full["final_weights_equal_clean"] and full["false_alarms"] == 0
    assert all(f["step"] >= f["planned_step"] for f in result["faults"]["replay_every=1"])
    assert -0.5 < result["overhead_frac"] < 1.0  # a timing on a shared machine: only its sanity
    over = next(r for r in result["table"] if r["arm"] == "recording overhead")
    assert 0 < over["overhead_frac_in_step"] < 0.5
    killed = next(r for r in result["table"] if r["arm"] == "elastic, replica 1 killed")
    assert killed["min_participants"] == 1 and killed["steps_alone"] >= 1
    if killed["rejoined_at_step"] is not None:  # it came back while replica 0 was still training
        assert killed["replicas_identical"] and killed["rejoined_at_step"] > killed["killed_at_step"]
    assert result["elastic"]["throughput_kept"] > 0


def test_arms_can_be_skipped(tmp_path):
    """``policies=[]`` and ``overhead_reps=0`` skip the flip runs and the overhead arm (the elastic pairs
    alone are then a separate results file); the issue's keys are then None, not made up."""
    result = bench.load("faults").run(["policies=[]", "overhead_reps=0", "elastic_pairs=0"], tmp_path)
    assert result["table"] == [] and result["faults"] == {}
    assert result["detection_rate"] is None and result["overhead_frac"] is None and "elastic" not in result
