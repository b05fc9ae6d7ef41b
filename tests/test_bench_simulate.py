"""``tidal bench simulate``: the validation harness on a short simulation (the numbers are checked
in docs/simulate.md; here, that the rows, errors and plot come out consistent)."""

import json

from tidal.bench import load


def test_simulate_benchmark_compares_prediction_with_the_measured_ratio(tmp_path):
    module = load("simulate")
    out = module.run(["areal=false", "steps=6"], tmp_path / "bench")
    measured = json.loads((module.RESULTS / "async.json").read_text())["async_over_sync"]
    rows = out["table"]
    assert [r["what"] for r in rows] == [f"cpu: {name}" for name in module.CPU_ABLATIONS]
    for r in rows:
        assert r["measured_ratio"] == measured
        assert abs(r["rel_error"] - (r["pred_ratio"] / measured - 1)) < 1e-12
        assert r["pred_async_staleness"] <= 2  # the cpu preset's eta
    assert out["cpu"]["within_15pct"] == (abs(out["cpu"]["rel_error"]) <= 0.15)
    assert out["areal"] is None
    assert (tmp_path / "simulate.png").stat().st_size > 0
