"""``tidal bench moe``: one run's summary and the headline on synthetic histories, and the harness on a toy size."""

import json

import pytest

from tidal import bench

from .test_bench_quickstart import TOY

moe = bench.load("moe")


def history(agreement: float, mismatch: float, accs: list[float], loss: float = 0.5) -> list[dict]:
    out = []
    for i, acc in enumerate(accs):
        step = 10 * i
        row = {"step": step, "eval/accuracy": acc}
        if step:
            row.update({"moe/routing_agreement": agreement, "train/logp_mismatch_kl": mismatch,
                        "train/logp_mismatch_mean": 2 * mismatch, "train/extreme_token_frac": mismatch / 2,
                        "train/logp_mismatch_max": 10 * mismatch, "train/loss": loss, "time/elapsed_s": float(step)})
        out.append(row)
    return out


def test_summary_of_one_run():
    row = moe.summarize_run(history(0.99, 0.02, [0.4, 0.7, 0.86, 0.9]))
    assert row["steps_to_0.85"] == 20 and row["final"] == 0.9 and not row["collapsed"]
    assert row["agreement"] == pytest.approx(0.99) and row["mismatch"] == pytest.approx(0.02) and row["rl_s"] == 30.0
    assert moe.summarize_run(history(0.99, 0.02, [0.4, 0.8, 0.45]))["collapsed"]  # 0.35 below its best
    assert moe.summarize_run(history(0.99, 0.02, [0.4, 0.35]))["collapsed"]  # below its base
    assert moe.summarize_run(history(0.99, 0.02, [0.4, 0.6], loss=float("nan")))["collapsed"]


def test_headline_ratios_per_seed():
    rows = [{"arm": arm, "seed": seed, **moe.summarize_run(history(agree, mis * (1 + seed), [0.4, 0.9]))}
            for seed in (0, 1) for arm, agree, mis in (("off", 0.98, 0.04), ("r3", 0.98, 0.01))]
    out = moe.headline(rows, ["off", "r3"], [0, 1])
    assert out["routing_agreement_off"] == 0.98
    assert out["mismatch_off_over_r3"] == out["abs_mismatch_off_over_r3"] == pytest.approx(4.0)
    assert out["extreme_off_over_r3_by_seed"] == [pytest.approx(4.0)] * 2
    assert out["steps_to_0.85_by_arm"] == {"off": [10, 10], "r3": [10, 10]}
    assert out["collapsed_runs_by_arm"] == {"off": 0, "r3": 0}


def test_an_unknown_arm_is_named():
    with pytest.raises(ValueError, match="unknown \\['r4'\\]"):
        moe._settings(["arms=[r4]"])


@pytest.mark.slow
def test_run_on_a_toy_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toy = [*TOY, "model.expert_intermediate_size=16", "rollout.prompts_per_step=4"]
    result = moe.run([*toy, "seeds=[0]", "steps=2", "arms=[off,r3]"], tmp_path / "results" / "moe")
    assert [r["arm"] for r in result["table"]] == ["off", "r3"]
    assert 0 < result["routing_agreement_off"] <= 1
    json.dumps(result)
    again = moe.run([*toy, "seeds=[0]", "steps=2", "arms=[off,r3]"], tmp_path / "results" / "moe")
    assert again["table"] == result["table"]  # read back from runs.jsonl, not run again
