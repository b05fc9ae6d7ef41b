"""``tidal bench diloco`` keeps its contract on a toy size: a table row per arm, and byte ratios that are
exactly H (both arms count the same fp32 payload)."""

import pytest

from tidal import bench

pytest.importorskip("torchft", reason="torchft not installed (pip install -e '.[dev]')")


@pytest.mark.slow
def test_bench_diloco_toy(tmp_path):
    result = bench.load("diloco").run(["steps=4", "sync_every=[2,4]", "adaptive_h=2", "seeds=[0]",
                                       "batch_size=4", "seq_len=16"], tmp_path)
    rows = {row["arm"]: row for row in result["table"]}
    assert list(rows) == ["data parallel", "DiLoCo H=2", "DiLoCo H=4", "DiLoCo H=2 + AdLoCo"]
    assert rows["DiLoCo H=2"]["bytes_ratio_vs_dp"] == 2 and rows["DiLoCo H=4"]["bytes_ratio_vs_dp"] == 4
    assert rows["DiLoCo H=2"]["rounds"] == 2 and rows["data parallel"]["rounds"] == 4
    assert rows["data parallel"]["MB_sent_per_worker"] * 2**20 == 4 * result["params"] * 4
    assert rows["data parallel"]["loss_gap_vs_dp"] == 0.0
    assert rows["DiLoCo H=2 + AdLoCo"]["examples_per_worker"] >= 4 * 4
