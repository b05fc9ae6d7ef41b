"""``tidal bench checkpoint`` on a small stand-in model (the 0.5B-shaped numbers are in docs/benchmarks.md):
the overheads are the medians' ratios, every arm timed as often, the checkpoints removed at the end."""

import statistics

from tidal.bench import load


def test_checkpoint_benchmark_reports_consistent_overheads(tmp_path):
    module = load("checkpoint")
    out = module.run(["model=stand-in", "num_layers=1", "seq_len=32", "steps=2", "repeats=2"], tmp_path / "bench")
    times = out["step_times_s"]
    assert {arm: len(ts) for arm, ts in times.items()} == {"none": 4, "sync": 4, "async": 4}
    none = statistics.median(times["none"])
    assert out["async_ckpt_overhead_frac"] == statistics.median(times["async"]) / none - 1
    assert out["sync_ckpt_overhead_frac"] == statistics.median(times["sync"]) / none - 1
    assert [r["arm"] for r in out["table"]] == ["none", "sync", "async"] and out["table"][0]["overhead_frac"] == 0
    # weights once (tied), two AdamW moments: what the checkpoint holds, plus the tokenizer and small files
    assert 0 <= out["state_bytes"] - 3 * 4 * out["params"] < 4 * 100  # plus AdamW's one-number step counters
    assert out["state_bytes"] < out["checkpoint_bytes"] < out["state_bytes"] + 2_000_000
    assert out["async_background_write_s_median"] > 0 and out["sync_save_s_median"] > 0
    assert not (tmp_path / "bench" / "ckpt").exists()
