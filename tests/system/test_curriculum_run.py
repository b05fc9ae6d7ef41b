"""The curriculum through whole runs: per-task metrics, exact resume, async(eta=0) == sync, the hooks."""

import json

import pytest
import torch

from tidal.system.run import prepare

from .test_controller import comparable, params, run, tiny_cfg

MIXTURE = ("curriculum.mixture=[{name: add, task: {name: addition, num_eval: 8}, weight: [[0, 1.0], [3, 0.2]]}, "
           "{name: rep, task: {name: repeat, max_repeat: 4, num_eval: 8}, reward: exact_match, weight: "
           "[[0, 0.0], [3, 0.8]]}]")
ONLINE = ["curriculum.difficulty.enabled=true", "curriculum.difficulty.pass_threshold=0.5"]
GROWTH = ["rollout.length_growth.stages=[3,4,6]", "rollout.length_growth.window=1"]
KEYS = (*[k for k in ("reward/", "algo/", "train/", "eval/", "rollout/response", "async/staleness")],
        "curriculum/", "rollout/length")


def curriculum_rows(history):
    return [{k: v for k, v in row.items() if k == "step" or k.startswith(KEYS)} for row in history]


def test_mixture_logs_per_task_rewards_and_accuracy(tmp_path):
    _, result = run(tiny_cfg(tmp_path, MIXTURE, "system.mode=sync", "max_steps=4", "num_eval=null"), tmp_path / "m")
    base, last = result.history[0], result.history[-1]
    assert {"eval/add/accuracy", "eval/rep/accuracy"} <= set(base) and "eval/accuracy" in base
    assert result.history[1]["curriculum/add/weight"] == 1.0 and "reward/rep/mean" not in result.history[1]
    assert last["curriculum/add/weight"] == 0.2 and "reward/rep/mean" in last
    # eval/accuracy is over every held-out prompt: the mean of the two equal-sized tasks' accuracies
    assert base["eval/accuracy"] == (base["eval/add/accuracy"] + base["eval/rep/accuracy"]) / 2


def test_resume_with_mixture_online_difficulty_and_length_growth_equals_uninterrupted(tmp_path):
    opts = [MIXTURE, *ONLINE, *GROWTH, "system.mode=sync", "rollout.dynamic_sampling=true"]
    full_c, full_r = run(tiny_cfg(tmp_path, *opts), tmp_path / "full")
    assert any(r.get("curriculum/add/seen_frac", 0) > 0 for r in full_r.history), "the sampler must learn"
    assert full_r.history[-1]["rollout/length_stage"] > 0, "the length must grow within the run"
    run(tiny_cfg(tmp_path, *opts, "max_steps=2"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *opts), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert curriculum_rows(rows) == curriculum_rows(full_r.history)
    assert resumed_c.source.state_dict() == full_c.source.state_dict()
    assert resumed_c.length_growth.state_dict() == full_c.length_growth.state_dict()
    a, b = params(full_c), params(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("repeat", range(3))
def test_async_eta0_equals_sync_with_online_difficulty(tmp_path, repeat):
    """With dynamic sampling and a draw limit steps reach: a dropped group's slot is given back at once,
    and at the limit the next index belongs to the next step; the staleness manager's ceiling keeps
    async from drawing it (with the counts before the step's update) sooner than sync does. Thread
    timing differs run to run, so the comparison runs several times."""
    opts = [*ONLINE, *GROWTH, "rollout.max_staleness=0", "rollout.dynamic_sampling=true",
            "rollout.max_draws_per_step=2"]
    sync_c, sync_r = run(tiny_cfg(tmp_path, *opts, "system.mode=sync"), tmp_path / "s")
    async_c, async_r = run(tiny_cfg(tmp_path, *opts, "system.mode=async"), tmp_path / "a")
    assert sum(r.get("algo/dropped_groups", 0) for r in sync_r.history) > 0
    assert sum(r.get("algo/shortfall_groups", 0) for r in sync_r.history) > 0, "a step must reach the limit"
    assert curriculum_rows(sync_r.history) == curriculum_rows(async_r.history)
    assert comparable(sync_r.history) == comparable(async_r.history)
    assert sync_c.source.state_dict() == async_c.source.state_dict()


def test_length_bias_hook_stops_or_lowers_the_judge(tmp_path, capsys):
    judge = ["reward.name=compose", "reward.params={terms: [{reward: digit_match, name: judge, weight: 0.5}]}",
             "reward.length_bias.component=judge", "reward.length_bias.threshold=-1.0", "max_steps=3",
             "system.mode=sync", "rollout.max_new_tokens=8"]
    _, result = run(tiny_cfg(tmp_path, *judge, "reward.length_bias.action=stop"), tmp_path / "stop")
    assert result.stopped_because.startswith("length bias: step ") and result.steps < 3
    assert "length bias: step" in capsys.readouterr().err
    c, result = run(tiny_cfg(tmp_path, *judge, "reward.length_bias.action=lower_weight",
                             "reward.length_bias.factor=0.5"), tmp_path / "lower")
    fired = result.history[-1]["reward/length_bias_fired"]
    assert fired >= 1 and c.reward_pool.fn.weight("judge") == 0.5 * 0.5 ** fired
    resumed = prepare(tiny_cfg(tmp_path, *judge, "reward.length_bias.action=lower_weight",
                               "reward.length_bias.factor=0.5", "max_steps=4"), tmp_path / "lower", resume=True)
    try:  # the lowered weight is part of the run's state: --resume restores it
        assert resumed.reward_pool.fn.weight("judge") == 0.5 * 0.5 ** fired
    finally:
        resumed.tracker.close()


def test_thinking_budgets_in_training_and_evaluation(tmp_path):
    _, result = run(tiny_cfg(tmp_path, "rollout.thinking.budgets=[0,2]", "rollout.thinking.eval_budget=0",
                             "rollout.max_new_tokens=12", "system.mode=sync", "max_steps=2"), tmp_path / "t")
    assert 0 < result.history[1]["rollout/think_forced_frac"] <= 1
    assert result.history[0]["eval/response_len_mean"] >= len("</think>")  # every eval response forced first


AIOLI = ["curriculum.mixture=[{name: add, task: {name: addition, num_eval: 8}}, {name: rep, task: {name: repeat, "
         "max_repeat: 4, num_eval: 8}, reward: exact_match}]", "curriculum.mixture_schedule=aioli",
         "curriculum.aioli.update_steps=3", "curriculum.aioli.lp_steps=1", "curriculum.aioli.one_hot_factor=0.75",
         "system.mode=sync", "max_steps=6", "num_eval=null"]


def test_aioli_schedule_sweeps_then_updates_and_resumes_exactly(tmp_path):
    full_c, full_r = run(tiny_cfg(tmp_path, *AIOLI), tmp_path / "full")
    schedule = full_c.source.mixture.dynamic
    # rounds of 3 steps: two one-task sweeps, then the proportions; each update applies from the next round's
    # first undrawn step (steps 3 and 6)
    assert [s for s, _ in schedule.history] == [0, 3, 6]
    assert all(abs(sum(p) - 1) < 1e-9 for _, p in schedule.history)
    weights = {r["step"]: (r["curriculum/add/weight"], r["curriculum/rep/weight"])
               for r in full_r.history if "curriculum/add/weight" in r}
    assert sorted(weights[1]) == [0.25, 0.75] or sorted(weights[2]) == [0.25, 0.75], weights
    run(tiny_cfg(tmp_path, *AIOLI, "max_steps=4"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *AIOLI), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert curriculum_rows(rows) == curriculum_rows(full_r.history)
    assert resumed_c.source.state_dict() == full_c.source.state_dict()
