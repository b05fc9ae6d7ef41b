"""``tidal bench checkpoint`` on a small stand-in model (the 0.5B-shaped numbers are in docs/benchmarks.md):
the overheads are the medians' ratios, every arm timed as often, the checkpoints removed at the end."""

import statistics

from tidal.bench import load


def test_checkpoint_benchmark_reports_consistent_overheads(tmp_path):
    module = load("checkpoint")
    out = module.run(["model=stand-in", "num_layers=[1,2]", "seq_len=32", "steps=2", "repeats=2"], tmp_path / "bench")
    assert list(out["runs"]) == ["1", "2"] and [r["layers"] for r in out["table"]] == [1, 1, 1, 2, 2, 2]
    assert out["model"] == out["runs"]["1"]["model"] and "1 decoder layers" in out["model"]
    first = out["runs"]["1"]
    times = first["step_times_s"]
    assert {arm: len(ts) for arm, ts in times.items()} == {"none": 4, "sync": 4, "async": 4}
    none = statistics.median(times["none"])
    assert out["async_ckpt_overhead_frac"] == statistics.median(times["async"]) / none - 1
    assert out["sync_ckpt_overhead_frac"] == statistics.median(times["sync"]) / none - 1
    assert [r["arm"] for r in out["table"][:3]] == ["none", "sync", "async"] and out["table"][0]["overhead_frac"] == 0
    # weights once (tied), two AdamW moments: what the checkpoint holds, plus the tokenizer and small files
    assert 0 <= first["state_bytes"] - 3 * 4 * first["params"] < 4 * 100  # plus AdamW's one-number step counters
    assert first["state_bytes"] < first["checkpoint_bytes"] < first["state_bytes"] + 2_000_000
    assert first["async_background_write_s_median"] > 0 and first["sync_save_s_median"] > 0
    assert out["runs"]["2"]["params"] > first["params"]
    assert not (tmp_path / "bench" / "ckpt").exists()
