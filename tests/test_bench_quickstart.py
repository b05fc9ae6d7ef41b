"""``tidal bench quickstart``: the per-seed summary on synthetic curves, and the harness on a toy size."""

import json

import pytest

from tidal import bench

qs = bench.load("quickstart")
TOY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
       "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8", "num_eval=8",
       "rollout.prompts_per_step=2", "rollout.group_size=2", "algo.passk_k=2", "eval_every=1", "reward.num_workers=0"]


def test_summary_of_one_curve():
    curve = [(0, 0.0, 0.3), (10, 5.0, 0.6), (20, 10.0, 0.82), (30, 15.0, 0.7), (40, 20.0, 0.86), (50, 25.0, 0.84)]
    row = qs.summarize_seed(curve, [0.8, 0.85])
    assert row == {"base": 0.3, "steps_to_0.8": 20, "s_to_0.8": 10.0, "steps_to_0.85": 40, "s_to_0.85": 20.0,
                   "final": 0.84, "best": 0.86, "late_swing": pytest.approx(0.12)}
    assert qs.late_swing([(0, 0.0, 0.5), (10, 1.0, 0.2)]) == 0.0  # an early dip is not a late swing
    assert qs.first_reaching(curve, 0.9) == (None, None)


def test_headline_counts_seeds_and_ranks_a_seed_that_never_got_there_last():
    rows = [{"base": b, "steps_to_0.8": s8, "s_to_0.8": s8, "steps_to_0.85": s85, "s_to_0.85": s85,
             "final": 0.9, "best": 0.9, "late_swing": 0.02}
            for b, s8, s85 in [(0.3, 20, 40), (0.35, 30, None), (0.4, None, None)]]
    out = qs.headline(rows, [0.8, 0.85], 0.85)
    assert out["num_seeds"] == 3 and out["seeds_reaching_target"] == 1
    assert out["median_steps_to_0.8"] == 30 and out["median_steps_to_0.85"] is None
    assert out["range_base"] == [0.3, 0.4] and out["median_base"] == 0.35


def test_each_seed_moves_the_init_the_data_order_and_the_sampling():
    s, cfg = qs.resolve(["seeds=[3]", "optim.lr=1e-4", "steps=7"], 3)
    assert s.seeds == [3] and (cfg.seed, cfg.model.init_seed, cfg.sft.seed) == (3, 3, 3)
    assert cfg.max_steps == 7 and cfg.target_accuracy is None and cfg.optim.lr == 1e-4


def test_run_on_a_toy_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the warm start caches under ./.tidal_cache
    result = qs.run([*TOY, "seeds=[0,1]", "steps=2"], tmp_path / "results" / "quickstart")
    assert [r["seed"] for r in result["table"]] == [0, 1]
    assert {"num_seeds", "seeds_reaching_target", "median_steps_to_0.8"} <= set(result)
    assert result["num_seeds"] == 2 and [s for s, _, _ in result["curves"]["0"]] == [0, 1, 2]
    json.dumps(result)


def test_spearman_against_hand_computed_ranks():
    # ranks x: 1 2 3 4, y: 2 1 4 3 -> d^2 = 1+1+1+1 = 4, rho = 1 - 6*4/(4*15) = 0.6
    assert qs.spearman([1, 2, 3, 4], [20, 10, 40, 30]) == pytest.approx(0.6)
    # a seed that never reached the threshold (None) ranks last: y ranks 1 2 3 4 -> rho = 1
    assert qs.spearman([0.1, 0.2, 0.3, 0.4], [10, 20, 30, None]) == pytest.approx(1.0)
    assert qs.ranks([5, 1, 5, 3]) == [3.5, 1.0, 3.5, 2.0]  # ties share their average rank
    assert qs.spearman([1, 1, 1], [1, 2, 3]) is None and qs.spearman([1, 2], [2, 1]) is None


def test_headline_slowest_over_median_and_predictors():
    rows = [{"base": b, "warm_start_steps": w, "steps_to_0.8": s8, "s_to_0.8": s8, "steps_to_0.85": s8,
             "s_to_0.85": s8, "final": 0.9, "best": 0.9, "late_swing": 0.0, "step1_sampled_acc": a,
             "step1_zero_adv_frac": z, "step1_entropy": None}
            for b, w, s8, a, z in [(0.36, 300, 80, 0.20, 0.3), (0.40, 310, 20, 0.25, 0.1),
                                   (0.38, 320, 40, 0.22, 0.2)]]
    out = qs.headline(rows, [0.8, 0.85], 0.85)
    assert out["slowest_over_median_steps_to_0.8"] == 2.0  # 80 / median 40
    rho = out["spearman_with_steps_to_0.8"]
    assert rho["base"] == pytest.approx(-1.0) and rho["step1_zero_adv_frac"] == pytest.approx(1.0)
    assert "step1_entropy" not in rho  # not logged: left out rather than guessed
    assert rho["warm_start_steps"] == pytest.approx(-0.5)  # ranks 1 2 3 vs 3 1 2: 1 - 6*6/24


def test_first_step_reads_the_first_trained_step():
    history = [{"step": 0, "eval/accuracy": 0.4},
               {"step": 1, "reward/accuracy": 0.25, "algo/zero_adv_groups": 32.0, "algo/drawn_groups": 128,
                "train/entropy": 0.6}, {"step": 2, "reward/accuracy": 0.3}]
    assert qs.first_step(history) == {"step1_sampled_acc": 0.25, "step1_zero_adv_frac": 0.25, "step1_entropy": 0.6}
    assert qs.first_step([])["step1_sampled_acc"] is None


def test_replicates_resample_rl_on_the_same_base():
    _, first = qs.resolve(["replicates=3"], 4, 0)
    _, third = qs.resolve(["replicates=3"], 4, 2)
    assert (first.seed, third.seed) == (4, 2004)  # RL's sampling moves
    assert (third.model.init_seed, third.sft.seed) == (4, 4)  # the warm-started base does not
    with pytest.raises(ValueError, match="replicates=0"):
        qs.resolve(["replicates=0"], 0)


def test_a_base_is_reported_by_the_median_of_its_replicates():
    reps = [{"seed": 5, "replicate": r, "warm_start_steps": 448, "base": 0.426, "steps_to_0.8": s8,
             "s_to_0.8": t8, "steps_to_0.85": s85, "s_to_0.85": s85, "final": f, "best": f, "late_swing": 0.0,
             "step1_entropy": None}
            for r, s8, t8, s85, f in [(0, 70, 75.0, None, 0.84), (1, 50, 52.0, 80, 0.88), (2, 60, 66.0, 90, 0.86)]]
    row = qs.over_replicates(reps)
    assert row["steps_to_0.8"] == 60 and row["s_to_0.8"] == 66.0
    assert row["steps_to_0.85"] == 90  # the run that never got there counts as the slowest, not as missing
    assert row["replicate_steps_to_0.8"] == [70, 50, 60] and row["replicate_steps_to_0.85"] == [None, 80, 90]
    assert row["final"] == 0.86 and row["seed"] == 5 and "replicate" not in row
    assert row["step1_entropy"] is None
    reps[1]["steps_to_0.8"] = None
    assert qs.over_replicates(reps)["steps_to_0.8"] == 70  # median of 60, 70, never


def test_replicates_on_a_toy_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = qs.run([*TOY, "seeds=[0]", "steps=1", "replicates=2"], tmp_path / "results" / "quickstart")
    assert [(r["seed"], r["replicate"]) for r in result["runs"]] == [(0, 0), (0, 1)]
    assert len(result["table"]) == 1 and len(result["table"][0]["replicate_steps_to_0.8"]) == 2
    assert set(result["curves"]) == {"0/0", "0/1"} and result["replicates"] == 2
    assert "slowest_run_over_median_steps_to_0.8" in result
    json.dumps(result)


def test_the_twenty_seed_command_in_the_docs_names_seeds_0_to_19():
    """docs/benchmarks.md's 20-seed line (issue 55) parses against the benchmark's settings as written."""
    import re
    import shlex
    from pathlib import Path

    from tidal.config import apply_overrides

    module = bench.load("quickstart")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    (line,) = [x for x in re.findall(r"^tidal bench quickstart.*$", doc, flags=re.M) if "19]" in x]
    args = shlex.split(line)[3:]
    settings = apply_overrides(module.Settings(), [args[i + 1] for i, a in enumerate(args) if a == "--set"])
    assert settings.seeds == list(range(20)) and settings.steps == 150
