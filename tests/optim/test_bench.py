"""``tidal bench optimizers`` keeps its contract (a table row per optimizer, equal steps, a plot), on a toy size."""

from pathlib import Path

from tidal import bench


def test_optimizers_benchmark_runs(tmp_path):
    module = bench.load("optimizers")
    toy = ["steps=3", "lrs=[1e-3, 1e-2]", "eval_every=2", "batch_size=2", "seq_len=16", "eval_windows=2",
           "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64"]
    result = module.run(toy, tmp_path / "optimizers")
    assert [r["optimizer"] for r in result["table"]] == ["adamw", "ademamix", "muon"] * 2  # two lrs
    for row, curve in zip(result["table"], result["curves"].values()):
        assert curve["step"] == [0, 2, 3] and row["heldout_loss"] == curve["heldout"][-1]
        assert row["steps_at_equal_time"] <= 3 and row["train_s"] >= row["equal_time_s"]
    assert Path(result["plot"]).stat().st_size > 0
    assert result["summary"][-1].startswith("each at its best lr")
