"""``tidal bench distill``: its headline formulas, and the whole harness (every method) on a toy size."""

import math

import pytest

from tidal import bench

bd = bench.load("distill")


def test_gap_closed_and_accuracy_within_the_budget():
    assert bd.gap_closed(0.9, 0.8, 1.0) == pytest.approx(0.5)
    assert bd.gap_closed(0.7, 0.8, 1.0) == pytest.approx(-0.5)  # worse than RL alone
    assert math.isnan(bd.gap_closed(0.9, 0.9, 0.9))
    curve = [{"step": 0, "seconds": 0.0, "accuracy": 0.3}, {"step": 10, "seconds": 5.0, "accuracy": 0.6},
             {"step": 20, "seconds": 12.0, "accuracy": 0.8}]
    assert bd.within(curve, 10.0) == 0.6 and bd.within(curve, 12.0) == 0.8 and bd.within(curve, 1.0) == 0.3


def test_k32_gap_is_the_median_over_seeds_with_the_noise_floor():
    per_seed = [{"k32_eval_kl": 1.1, "full_eval_kl": 1.0, "objective_gap": 1e-5},
                {"k32_eval_kl": 0.9, "full_eval_kl": 1.2, "objective_gap": 3e-5},
                {"k32_eval_kl": 1.0, "full_eval_kl": 0.8, "objective_gap": 2e-5}]
    got = bd.k32_summary(per_seed)
    assert got["gaps"] == pytest.approx([0.1, -0.25, 0.25])
    assert got["median_gap"] == pytest.approx(0.1) and got["min_gap"] == pytest.approx(-0.25)
    assert got["full_seed_spread"] == pytest.approx(1.2 / 0.8 - 1) and got["median_objective_gap"] == 2e-5
    assert bd.median([3.0, 1.0, 2.0, 10.0]) == 2.5


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="unknown \\['distil'\\]"):
        bd.resolve(["methods=[rl,distil]"])


def test_every_method_on_a_toy_size(tmp_path, teacher_dir, monkeypatch):
    from ..system.test_controller import TINY_OVERRIDES

    monkeypatch.chdir(tmp_path)
    toy = [o for o in TINY_OVERRIDES(tmp_path) if not o.startswith(("max_steps", "max_time_s", "eval_every"))]
    result = bd.run([*toy, f"teacher={teacher_dir}", "budget_s=30", "rl_steps=2", "student_steps=2",
                     "eval_every_rl=1", "eval_every_student=1", "num_prompts=8", "samples_per_prompt=2", "min_reward=0",
                     "traces_rl_sft_steps=1", "ks=[1,32]", "kl_seeds=[0,1]", "kl_steps=2"], tmp_path / "out")
    methods = [row["method"] for row in result["table"]]
    assert methods == ["rl", "traces", "traces_rl", "logits_k1", "logits_k32", "logits_full", "on_policy"]
    seeds = result["k32_vs_full"]["per_seed"]
    assert [r["seed"] for r in seeds] == [0, 1]
    gaps = [r["k32_eval_kl"] / r["full_eval_kl"] - 1 for r in seeds]
    assert result["k32_rel_loss_gap"] == pytest.approx(sum(gaps) / 2)  # the median of two
    # the tail bucket never exceeds the full KL (up to fp16 rounding); this random teacher leaves ~30% of its
    # mass outside its top 32, so the sparse loss is well below it
    assert -1 < result["k32_rel_objective_gap"] < 1e-3
    assert "gap_closed" in result and result["best_distilled"] in methods
    by = {row["method"]: row for row in result["table"]}
    assert by["logits_k1"]["bytes_per_pos"] == 8 and by["logits_k32"]["bytes_per_pos"] == 132
    assert by["logits_k1"]["info_loss"] > by["logits_k32"]["info_loss"]
    assert by["traces_rl"]["steps"] == 1 + 2  # one SFT step, then two RL steps
    assert all(row["steps"] >= 1 for row in result["table"])


