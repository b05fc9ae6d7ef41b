"""Agent episodes through the whole run: eta=0 async == sync, the staleness bound, resume, infra failures."""

import json

import pytest
import torch

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.system.run import close, prepare
from tidal.types import Group, Trajectory

from .test_controller import comparable, params, run, run_interrupted_at, tiny_cfg


@ENVS.register("test_countdown")
class Countdown:
    """Answers every turn with an observation for ``turns`` turns, then ends: reward 1 if the last turn
    holds a digit (so rewards vary within a group and the run trains)."""

    stop: list[str] = []

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, prompt):
        return None

    def step(self, turn_text: str) -> EnvStep:
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep(None, float(any(c.isdigit() for c in turn_text)), done=True)
        return EnvStep(f"={self.seen} ", info={"tool_call": True})


AGENT = ("env.name=test_countdown", "rollout.max_new_tokens=4", "model.max_position_embeddings=64")


def _same_up_to_rounding(rows_a, rows_b):
    """Equal histories, except float rounding in log-prob-derived values: which turns share an engine
    forward depends on when each environment step returns, and a batch's composition moves the last
    bits of the engine's log-probs (tokens and rewards are unaffected: they are compared exactly)."""
    assert [sorted(r) for r in rows_a] == [sorted(r) for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for k in ra:
            if k.startswith(("reward/", "rollout/response", "agent/", "eval/")):
                assert ra[k] == rb[k], (ra["step"], k)
            else:
                assert ra[k] == pytest.approx(rb[k], abs=1e-5), (ra["step"], k)


def _close_params(a, b):
    """Parameters equal up to what rounding in the log-probs can do through Adam: a weight whose gradient
    is ~0 moves by up to lr (1e-2 here) in a direction the last bits decide, so compare the bulk tightly
    and bound the rest by the learning rate."""
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diffs.median() < 1e-6 and diffs.max() < 2e-2, (diffs.median(), diffs.max())


def test_agentic_async_with_zero_staleness_equals_sync(tmp_path):
    sync_c, sync_r = run(tiny_cfg(tmp_path, *AGENT, "system.mode=sync"), tmp_path / "sync")
    async_c, async_r = run(tiny_cfg(tmp_path, *AGENT, "system.mode=async", "rollout.max_staleness=0"),
                           tmp_path / "async")
    _same_up_to_rounding(comparable(sync_r.history), comparable(async_r.history))
    _close_params(params(sync_c), params(async_c))
    rows = [r for r in sync_r.history if "agent/turns_mean" in r]
    assert rows and all(r["agent/turns_mean"] == 3.0 for r in rows), "every episode runs its three turns"
    assert any(r.get("train/grad_norm", 0) > 0 for r in sync_r.history), "the test must actually train"


@pytest.mark.parametrize("eta", [1, 2])
def test_agentic_async_staleness_counts_from_the_oldest_sampled_token(tmp_path, eta):
    cfg = tiny_cfg(tmp_path, *AGENT, "system.mode=async", f"rollout.max_staleness={eta}", "max_steps=6")
    controller = prepare(cfg, tmp_path / f"a{eta}")
    seen: list = []
    real = controller._train_step

    def record(step, groups):
        seen.append((step, [t for g in groups for t in g.trajectories]))
        return real(step, groups)

    controller._train_step = record
    try:
        result = controller.run()
    finally:
        close(controller)
    assert result.steps == 6
    for step, trajs in seen:
        for t in trajs:
            sampled = [v for v, m in zip(t.versions, t.loss_mask) if m]
            assert step - min(sampled) <= eta
            assert all(v == -1 for v, m in zip(t.versions, t.loss_mask) if not m)
    spans = [len({v for v in t.versions if v >= 0}) for _, trajs in seen for t in trajs]
    assert max(spans) > 1, "some episode should span versions (between or within turns)"


def test_agentic_resume_equals_uninterrupted(tmp_path):
    full_c, full_r = run(tiny_cfg(tmp_path, *AGENT, "system.mode=sync"), tmp_path / "full")
    run(tiny_cfg(tmp_path, *AGENT, "system.mode=sync", "max_steps=2"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *AGENT, "system.mode=sync"), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same_up_to_rounding(comparable(rows), comparable(full_r.history))
    _close_params(params(full_c), params(resumed_c))


def _episode(uid, i, reward, failure=None):
    return Trajectory(uid, i, [1, 5], [6, 7, 8], [-0.5, 0.0, -0.25], [0, -1, 0], "stop", reward=reward,
                      loss_mask=[1, 0, 1], episode={"turns": 2, "tool_calls": 1, "tool_errors": 0,
                                                    "tool_timeouts": 0, "malformed": 0, "tool_latency_s": 0.1,
                                                    "infra_failure": failure, "num_versions": 1})


def test_infra_failures_are_left_out_of_the_group_baseline_and_counted(tmp_path):
    controller = prepare(tiny_cfg(tmp_path, *AGENT, "rollout.group_size=3"), tmp_path / "run")
    try:
        prompt = controller.task.train_prompt(0)
        trajs = [_episode(prompt.uid, 0, 1.0), _episode(prompt.uid, 1, 0.0, failure="step raised OSError"),
                 _episode(prompt.uid, 2, 0.0)]
        (group,) = controller._score([prompt], trajs)
        assert [t.sample_index for t in group.trajectories] == [0, 2]
        assert [t.reward for t in group.trajectories] == [1.0, 0.0], "episodes keep their environment's reward"
        metrics = controller._train_step(0, [group])
        assert metrics["agent/infra_failures"] == 1.0
        assert metrics["agent/turns_mean"] == 2.0 and metrics["reward/mean"] == 0.5
        all_failed = Group(prompt, [])
        groups, _ = controller._collect(lambda i, n: all_failed, 0, max_staleness=1)
        assert groups == [all_failed] * 4, "a group whose episodes all failed is not \"stale\""
    finally:
        close(controller)


def test_agentic_ctrl_c_then_resume_trains_journaled_episodes_once(tmp_path):
    out = tmp_path / "run"
    opts = (*AGENT, "system.mode=async", "rollout.max_staleness=1", "checkpoint_every=100", "max_steps=4")
    controller = prepare(tiny_cfg(tmp_path, *opts), out)
    run_interrupted_at(controller, 2)
    journaled = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    assert journaled and all(t["loss_mask"] is not None and t["episode"]["turns"] == 3
                             for j in journaled for t in j["group"]["trajectories"]), "episodes journaled whole"
    resumed = prepare(tiny_cfg(tmp_path, *opts), out, resume=True)
    try:
        result = resumed.run()
    finally:
        close(resumed)
    assert result.steps == 4
    assert result.history[-1]["async/reloaded_groups"] == len({j["index"] for j in journaled})
