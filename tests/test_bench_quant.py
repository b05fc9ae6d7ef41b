"""``tidal bench quant`` on a tiny model for 3 steps (the full-size numbers are in docs/quantization.md):
the rows and summaries come out consistent, and FP8 rollouts ship fewer bytes with a real log-prob gap."""

from tidal.bench import load

from .system.test_controller import TINY_OVERRIDES


def test_quant_benchmark_rows_are_consistent(tmp_path, monkeypatch):
    module = load("quant")
    monkeypatch.setattr(module, "SEEDS", (0,))
    out = module.run([*TINY_OVERRIDES(tmp_path), "max_steps=3", "eval_every=3"], tmp_path / "bench")
    rows = {r["rollout_weights"]: r for r in out["table"]}
    assert set(rows) == {"none", "fp8_block"} and all(r["steps"] == 3 for r in rows.values())
    assert rows["fp8_block"]["sync_bytes"] < 0.6 * rows["none"]["sync_bytes"]
    assert rows["none"]["logp_gap_mean"] < 1e-5 < 1e-4 < rows["fp8_block"]["logp_gap_mean"]
    assert out["mean_over_seeds"]["fp8_block"]["sync_bytes"] == rows["fp8_block"]["sync_bytes"]
    for sizes in out["sync_bytes"].values():
        assert sizes["bfloat16_bytes"] * 2 == sizes["float32_bytes"]
        assert sizes["fp8_block_bytes"] < sizes["bfloat16_bytes"]
        assert abs(sizes["fp8_over_float32"] - sizes["fp8_block_bytes"] / sizes["float32_bytes"]) < 1e-12
    planted = out["relative_error"]["random 512x512, 4 outlier channels x20"]
    assert planted["int4_block+hadamard"] < 0.5 * planted["int4_block"]  # the rotation's case
    assert 0.01 < planted["fp8_block"] < 0.04  # e4m3: ~2^-4 worst case per entry, ~2.6% in norm
