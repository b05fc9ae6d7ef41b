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


def test_k32_gap_is_read_at_matched_steps():
    sparse = [{"step": s, "eval_kl": v} for s, v in [(0, 9.0), (10, 2.0), (20, 1.1), (30, 1.0), (40, 0.5)]]
    full = [{"step": s, "eval_kl": v} for s, v in [(0, 9.0), (10, 2.0), (20, 1.0), (30, 1.0)]]
    gap, at = bd.matched_rel_gap(sparse, full, last=2)  # steps 20 and 30: (1.1 + 1.0) / (1.0 + 1.0) - 1
    assert at == 30 and gap == pytest.approx(0.05)
    assert bd.matched_rel_gap(sparse[:1], full) is None  # step 0 alone is no comparison


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="unknown \\['distil'\\]"):
        bd.resolve(["methods=[rl,distil]"])


def test_every_method_on_a_toy_size(tmp_path, teacher_dir, monkeypatch):
    from ..system.test_controller import TINY_OVERRIDES

    monkeypatch.chdir(tmp_path)
    toy = [o for o in TINY_OVERRIDES(tmp_path) if not o.startswith(("max_steps", "max_time_s", "eval_every"))]
    result = bd.run([*toy, f"teacher={teacher_dir}", "budget_s=30", "rl_steps=2", "student_steps=2",
                     "eval_every_rl=1", "eval_every_student=1", "num_prompts=8", "samples_per_prompt=2", "min_reward=0",
                     "traces_rl_sft_steps=1", "ks=[1,32]"], tmp_path / "out")
    methods = [row["method"] for row in result["table"]]
    assert methods == ["rl", "traces", "traces_rl", "logits_k1", "logits_k32", "logits_full", "on_policy"]
    kl = {m: [c["eval_kl"] for c in result["curves"][m] if c["step"] in (1, 2)] for m in ("logits_k32", "logits_full")}
    assert result["k32_rel_loss_gap"] == pytest.approx(sum(kl["logits_k32"]) / sum(kl["logits_full"]) - 1)
    assert result["k32_rel_loss_gap_at_step"] == 2
    assert "gap_closed" in result and result["best_distilled"] in methods
    by = {row["method"]: row for row in result["table"]}
    assert by["logits_k1"]["bytes_per_pos"] == 8 and by["logits_k32"]["bytes_per_pos"] == 132
    assert by["logits_k1"]["info_loss"] > by["logits_k32"]["info_loss"]
    assert by["traces_rl"]["steps"] == 1 + 2  # one SFT step, then two RL steps
    assert all(row["steps"] >= 1 for row in result["table"])


