"""Every metric key a run logs is documented in docs/metrics.md."""

import re
from pathlib import Path

from tidal.system.run import prepare

from .system.test_controller import tiny_cfg

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def documented() -> list[re.Pattern]:
    keys = re.findall(r"`([a-z_]+/[a-z_<>/]+)`", DOC.read_text())
    return [re.compile("^" + re.escape(k).replace("<name>", "[^/]+").replace("<task>", "[^/]+")
                       .replace("<expert>", "[0-9]+") + "$") for k in keys]


def test_every_logged_key_is_documented(tmp_path):
    patterns = documented()
    logged = set()
    for extra in (["system.mode=async", "rollout.dynamic_sampling=true", "algo.correction=tis",
                   "algo.guidance=all_fail"],
                  ["system.mode=sync", "algo.policy_loss=decoupled_ppo", "trainer.num_minibatches=2",
                   "algo.overlong_filter=true", "algo.kl_coef=0.1", "rollout.early_stop_run=3"],
                  ["system.mode=async", "task.name=sum_chain", "env.name=calculator"],
                  ["system.mode=sync", "algo.advantage=gae"],
                  ["system.mode=sync", "model.num_experts=4", "model.expert_intermediate_size=16", "rollout.dtype=bf16",
                   "trainer.moe.routing_replay=r3", "trainer.moe.mismatch_unreplayed=true"],
                  ["system.mode=sync", "curriculum.difficulty.enabled=true", "rollout.length_growth.stages=[4,6]",
                   "rollout.thinking.budgets=[0,2]", "rollout.max_new_tokens=12", "reward.name=compose",
                   "reward.params={terms: [{reward: digit_match, name: judge}]}", "reward.length_bias.component=judge",
                   "curriculum.mixture=[{name: add, task: {name: addition, num_eval: 8}}, "
                   "{name: rep, task: {name: repeat, max_repeat: 8, num_eval: 8}}]"],
                  ["system.mode=async", "task.name=product", "task.params={demos: chat_tool}", "model.tokenizer=chat",
                   "harness.function=tests.serve.test_harness_engine:two_turn_agent"]):
        controller = prepare(tiny_cfg(tmp_path, *extra, "max_steps=2"), tmp_path / str(len(logged)))
        try:
            result = controller.run()
        finally:
            controller.tracker.close()
            for engine in (controller.engine, controller.eval_engine):
                if hasattr(engine, "server"):  # a harness run's HTTP servers
                    engine.close()
        logged |= {k for row in result.history for k in row if k != "step"}
    missing = sorted(k for k in logged if not any(p.match(k) for p in patterns))
    assert not missing, f"undocumented metrics (add them to docs/metrics.md): {missing}"
