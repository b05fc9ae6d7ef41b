"""``tidal bench harness`` keeps its contract on a toy size: both arms run the same episodes, and the
ratio is the built-in arm's episodes/s over the harness arm's."""

import json

import pytest

from tidal import bench

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "prompts=3", "reps=1"]


@pytest.mark.slow  # ~1 min: verifiers starts its MCP tool server, then every turn crosses two HTTP hops
def test_harness_benchmark_verifiers_arm(tmp_path):
    pytest.importorskip("verifiers.v1")
    assert bench.run_benchmark("harness", [*TINY, "verifiers=true", f"sft.cache_dir={tmp_path / 'cache'}"],
                               str(tmp_path)) == 0
    result = json.loads((tmp_path / "harness.json").read_text())
    rows = {r["arm"]: r for r in result["table"]}
    assert set(rows) == {"builtin", "harness", "verifiers"} and rows["verifiers"]["episodes"] == 6
    assert rows["verifiers"]["failed"] == 0, "every verifiers episode must finish (none dropped as a failure)"
    assert result["verifiers_over_builtin"] == result["verifiers_episodes_per_s"] / result["builtin_episodes_per_s"]


def test_harness_benchmark_reports_the_http_overhead_ratio(tmp_path, capsys):
    assert bench.run_benchmark("harness", [*TINY, "verifiers=false", f"sft.cache_dir={tmp_path / 'cache'}"],
                               str(tmp_path)) == 0
    result = json.loads((tmp_path / "harness.json").read_text())
    assert {"http_overhead_ratio", "builtin_episodes_per_s", "harness_episodes_per_s"} <= set(result)
    rows = {r["arm"]: r for r in result["table"]}
    assert set(rows) == {"builtin", "harness"} and all(r["episodes"] == 6 and r["rep"] == 1 for r in rows.values())
    assert result["http_overhead_ratio"] == result["builtin_episodes_per_s"] / result["harness_episodes_per_s"]
    assert rows["harness"]["failed"] == 0, "the example agent must complete every episode"
    assert "| arm" in capsys.readouterr().out
