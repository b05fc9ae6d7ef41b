"""Training through the endpoint: ``tidal train`` with ``harness.function`` (sync and async), the
``harness_quickstart`` recipe end to end on a few steps, its target in a slow test, and config errors."""

from __future__ import annotations

import json

import pytest

from tidal.config import ConfigError, apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import prepare, train

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8",
        "rollout.group_size=4", "rollout.prompts_per_step=3", "rollout.max_new_tokens=8", "max_time_s=null",
        "target_accuracy=null", "num_eval=6", "eval_every=2", "checkpoint_every=2", "optim.lr=1e-2",
        "system.num_threads=1", "log.progress=false", "log.tensorboard=false", "log.report=false",
        "harness.max_concurrent_episodes=8"]
DIGIT_AGENT = "harness.function=tests.serve.test_harness_engine:two_turn_agent"


def cfg_for(tmp_path, *extra):
    return apply_overrides(RECIPES.get("harness_quickstart")(), [*TINY, f"sft.cache_dir={tmp_path / 'cache'}", *extra])


def run(cfg, out):
    controller = prepare(cfg, out)
    try:
        return controller.run()
    finally:
        controller.engine.close()
        controller.eval_engine.close()
        controller.tracker.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_harness_trains_in_both_modes_within_the_staleness_bound(tmp_path, mode):
    result = run(cfg_for(tmp_path, DIGIT_AGENT, f"system.mode={mode}", "max_steps=3", "rollout.max_staleness=1"),
                 tmp_path / mode)
    rows = result.history[1:]
    assert len(rows) == 3 and all(r["harness/started"] >= 12 * r["step"] for r in rows)
    assert all(r["harness/finished"] >= 12 * r["step"] for r in rows), "every trained episode finished"
    assert all(r["harness/crashed"] == 0 and r["agent/infra_failures"] == 0 for r in rows)
    assert all(r["agent/turns_mean"] == 2.0 for r in rows), "every episode made its two requests"
    assert max(r["async/staleness_max"] for r in rows) <= (1 if mode == "async" else 0)
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows), "the run must actually train"
    assert result.base_accuracy is not None and "eval/accuracy" in result.history[-1]


def test_an_agent_without_grading_code_trains_on_the_task_reward(tmp_path):
    """``harness.reward=task``: the agent returns None, the controller's reward pool scores its answers."""
    result = run(cfg_for(tmp_path, "harness.function=tests.serve.test_harness_engine:talking_agent",
                         "harness.reward=task", "system.mode=async", "max_steps=2"), tmp_path / "task")
    rows = result.history[1:]
    assert all(r["agent/infra_failures"] == 0 and r["harness/finished"] >= 12 * r["step"] for r in rows)
    assert "eval/accuracy" in result.history[-1]


def test_harness_quickstart_runs_end_to_end_with_the_example_agent(tmp_path):
    """The recipe as written (its example agent file, its chat tokenizer and task), on a tiny model."""
    out = tmp_path / "run"
    result = train(cfg_for(tmp_path, "max_steps=2"), out)
    assert result.steps == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["harness/started"] >= 2 * 3 * 4 and rows[-1]["harness/requests"] >= rows[-1]["harness/finished"] > 0
    assert (out / "report.html").exists() is False  # log.report=false in TINY
    cfg = json.dumps((out / "config.yaml").read_text())
    assert "examples/calculator_agent.py:run_episode" in cfg


@pytest.mark.parametrize("override, match", [
    ("harness.function=nocolon", "harness.function must be 'path/to/file.py:function'"),
    ("harness.function=examples/missing.py:run_episode", "harness.function=.*no file examples/missing.py"),
    ("harness.max_concurrent_episodes=2", "harness.max_concurrent_episodes=2 must be >= rollout.group_size=4"),
    ("env.name=calculator", "harness.function and env.name='calculator' are both set"),
    ("harness.serve.max_episodes=4", "harness.serve.max_episodes=4 must be >="),
    ("harness.episode_timeout_s=0", "harness.episode_timeout_s must be > 0 seconds"),
    ("harness.reward=judge", "harness.reward='judge': use 'agent'"),
    ("harness.command=python agent.py", "harness.function and harness.command are both set"),
])
def test_bad_harness_config_is_one_clear_error(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        prepare(cfg_for(tmp_path, override), tmp_path / "bad")


def test_a_missing_agent_program_fails_before_the_warm_start(tmp_path):
    with pytest.raises(ConfigError, match="no program 'no-such-agent-program'"):
        prepare(cfg_for(tmp_path, "harness.function=null", "harness.command=no-such-agent-program --x"), tmp_path / "b")
    assert not (tmp_path / "cache").exists(), "nothing was trained"


@pytest.mark.slow
def test_harness_quickstart_reaches_its_target(tmp_path):
    """The recipe as shipped (warm start included) reaches 0.8 held-out success within 10 minutes."""
    cfg = apply_overrides(RECIPES.get("harness_quickstart")(),
                          [f"sft.cache_dir={tmp_path / 'cache'}", "log.progress=false", "log.report=false"])
    result = train(cfg, tmp_path / "run")
    assert result.best_accuracy >= 0.8, result.history
    assert result.history[-1]["time/elapsed_s"] <= 600
