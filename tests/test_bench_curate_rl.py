"""``tidal bench curate_rl`` end to end on toy sizes (slow: a warm start, a curation pass and two RL
runs); the full-size run's numbers are in docs/benchmarks.md."""

import pytest

from tidal.bench import load


@pytest.mark.slow
def test_curate_rl_runs_curates_and_compares(tmp_path):
    out = load("curate_rl").run(["problems=60", "eval_problems=15", "samples=4", "sft_pool=300", "rl_steps=2",
                                 "eval_every=1", "seeds=2", "sft_steps=20",
                                 "min_pass_rate=0.0",  # a toy policy solves nothing: keep all
                                 "run=[rollout.prompts_per_step=4, model.hidden_size=32]"],
                                tmp_path / "bench")
    raw, curated = out["table"]
    assert raw["set"] == "raw" and raw["problems"] == 60 and curated["problems"] == round(out["kept_fraction"] * 60)
    assert sum(out["dropped"].values()) + curated["problems"] == 60
    assert out["target_accuracy"] == max(acc for _, acc in out["curves"]["raw"])
    assert [step for step, _ in out["curves"]["curated"]] == [0, 1, 2]
    assert len(out["seed_curves"]["raw"]) == 2  # the curves are the seeds' mean
    raw_seeds = out["seed_curves"]["raw"]
    assert out["curves"]["raw"][-1][1] == pytest.approx((raw_seeds[0][-1][1] + raw_seeds[1][-1][1]) / 2)
