"""``tidal bench curriculum`` end to end on toy sizes (slow: a warm start, a curation pass and six RL
runs); the full-size run's numbers are in docs/benchmarks.md."""

import pytest

from tidal.bench import load


@pytest.mark.slow
def test_curriculum_bench_runs_three_arms(tmp_path):
    out = load("curriculum").run(["problems=40", "eval_problems=15", "samples=4", "sft_pool=300", "rl_steps=2",
                                  "eval_every=1", "seeds=2", "sft_steps=20", "min_pass_rate=0.0",
                                  "run=[rollout.prompts_per_step=4, model.hidden_size=32]"], tmp_path / "bench")
    assert [row["arm"] for row in out["table"]] == ["uniform", "online", "offline"]
    for arm in ("uniform", "online", "offline"):
        seeds = out["seed_curves"][arm]
        assert len(seeds) == 2 and [s for s, _ in out["curves"][arm]] == [0, 1, 2]
        assert out[f"{arm}_final_accuracy"] == pytest.approx((seeds[0][-1][1] + seeds[1][-1][1]) / 2)
    cost = out["offline_pass"]
    assert cost["samples_generated"] == 40 * 4 and cost["kept"] + sum(cost["dropped"].values()) == 40
    assert cost["rl_steps_of_samples"] == pytest.approx(160 / (4 * 8))
