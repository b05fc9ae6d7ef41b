"""``tidal bench stages``'s harness at a toy size: tidal's side end to end and the summary's keys; TRL's side
runs (slow) when a python with TRL 1.16 is at hand (``TIDAL_TRL_PYTHON`` or the TRL bench venv), else it is skipped."""

import os
from pathlib import Path

import pytest

from tidal import bench

stages = bench.load("stages")
TOY = ["base_steps=2", "sft_steps=2", "dpo_steps=2", "eval_every=1", "num_pairs=100", "sft_batch=4", "dpo_batch=4",
       "rm_steps=2", "rm_batch=4"]


def test_time_to_is_the_first_evaluation_at_the_target():
    curve = [{"time_s": 1.0, "pref_acc": 0.5}, {"time_s": 2.0, "pref_acc": 0.9}, {"time_s": 3.0, "pref_acc": 0.95}]
    assert stages.time_to(curve, 0.9) == 2.0 and stages.time_to(curve, 0.96) is None


def test_tidal_side(tmp_path):
    result = stages.run([*TOY, "frameworks=[tidal]"], tmp_path)
    (row,) = result["table"]
    assert row["framework"] == "tidal" and row["sft_tokens_per_s"] > 0 and row["dpo_pairs_per_s"] > 0
    assert 0 <= result["dpo_pref_acc"] <= 1
    assert [p["step"] for p in result["runs"]["tidal"]["dpo"]["curve"]] == [1, 2]
    assert 0 <= result["rm_pair_acc"] <= 1 and result["rm"]["curve"][-1]["accuracy"] == result["rm_pair_acc"]


def _trl_python():
    root = Path(__file__).resolve().parents[1]
    python = os.environ.get("TIDAL_TRL_PYTHON") or root / ".tidal_cache" / "bench-trl-venv" / "bin" / "python"
    return str(python) if Path(python).exists() else None


@pytest.mark.slow  # ~2 min: TRL's import and trainers
def test_both_sides(tmp_path):
    python = _trl_python()
    if python is None:
        pytest.skip("no TRL environment: run `tidal bench trl` once or set TIDAL_TRL_PYTHON")
    result = stages.run([*TOY, "trl_sft_settings=[padded]", "frameworks=[tidal]"], tmp_path)
    s = stages.Settings(sft_steps=2, dpo_steps=2, eval_every=1, sft_batch=4, dpo_batch=4, trl_sft_settings=["padded"])
    from tidal.stages import synthetic

    files = synthetic.build(tmp_path / "domain", num_pairs=100)
    base = tmp_path / "base" / "model"
    sft = stages.trl_sft(s, files, base, tmp_path, python)
    dpo = stages.trl_dpo(s, files, base, tmp_path, python)
    assert sft["tokens_per_s"] > 0 and dpo["pairs_per_s"] > 0 and [p["step"] for p in dpo["curve"]] == [1, 2]
    assert result["dpo_pref_acc"] is not None
