"""``tidal bench checkpoint`` on a small stand-in model (the 0.5B-shaped numbers are in docs/benchmarks.md): every
arm timed in every repeat, the headline numbers the medians of per-repeat ratios, the checkpoints removed."""

import json
import statistics

from tidal.bench import load


def test_checkpoint_benchmark_reports_per_repeat_medians(tmp_path):
    module = load("checkpoint")
    out = module.run(["model=stand-in", "num_layers=1", "seq_len=32", "every=[1,3]", "steps=2", "steps_none=2",
                      "repeats=3"], tmp_path / "bench")
    assert [r["arm"] for r in out["table"]] == ["none", "sync_every1", "async_every1", "deferred_every1", "sync_every3",
                                                "async_every3", "deferred_every3"]
    assert "1 decoder layers" in out["model"] and out["table"][0]["overhead_frac"] == 0
    steps = out["step_times_s"]
    assert len(steps) == 3 and {arm: len(ts) for arm, ts in steps[0].items()} == {
        "none": 2, "sync_every1": 2, "async_every1": 2, "deferred_every1": 2, "sync_every3": 3, "async_every3": 3,
        "deferred_every3": 3}
    ratios = [statistics.fmean(r["async_every3"]) / statistics.fmean(r["none"]) - 1 for r in steps]
    assert out["async_overhead_frac_every3"] == statistics.median(ratios)
    assert out["spread"]["async_overhead_frac_every3"] == [min(ratios), max(ratios)]
    for key in ("step_s_no_save", "step_s_sync_every1", "step_s_async_every3", "sync_save_s", "writer_cpu_s_per_gb",
                "blocking_s_per_checkpoint", "blocking_s_per_checkpoint_every1", "legacy_save_s",
                "deferred_blocking_s_per_checkpoint", "step_s_deferred_every3"):
        assert out[key] > 0 and len(out["per_repeat"][key]) == 3, key
    assert out["async_blocking_over_sync"] == statistics.median(out["per_repeat"]["async_blocking_over_sync"])
    assert out["deferred_blocking_over_sync"] == statistics.median(out["per_repeat"]["deferred_blocking_over_sync"])
    # weights once (tied), two AdamW moments: what the checkpoint holds, plus the tokenizer and small files
    assert 0 <= out["state_bytes"] - 3 * 4 * out["params"] < 4 * 100  # plus AdamW's one-number step counters
    assert out["state_bytes"] < out["checkpoint_bytes"] < out["state_bytes"] + 2_000_000
    assert "async_overhead_frac_every10 <= 0.05" not in out["goals"]  # no every-10 arm in this run
    assert not (tmp_path / "bench" / "ckpt").exists()

    # repeats split across runs (a loaded machine): merged, they are reported as one run's
    (tmp_path / "a.json").write_text(json.dumps(out))
    merged = module.run([f"merge=[{tmp_path / 'a.json'},{tmp_path / 'a.json'}]"], tmp_path / "bench")
    assert merged["repeats"] == 6 and merged["async_overhead_frac_every3"] == out["async_overhead_frac_every3"]
    assert merged["per_repeat"]["sync_save_s"] == 2 * out["per_repeat"]["sync_save_s"]
    assert merged["table"] == out["table"] and merged["params"] == out["params"]
