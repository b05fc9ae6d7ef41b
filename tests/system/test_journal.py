"""The group journal: scored groups survive Ctrl-C and are trained once after --resume, not regenerated."""

import json

import pytest
import torch

from tidal.system.journal import GroupJournal
from tidal.system.run import close, prepare
from tidal.train.checkpoint import latest_checkpoint
from tidal.types import Group, Prompt, Trajectory

from .test_controller import run_interrupted_at, tiny_cfg


def group(uid, versions, reward=1.0):
    trajs = [Trajectory(uid, j, [1, 2], [3] * len(versions), [-0.1 / 3] * len(versions), list(versions), "stop",
                        text="42", reward=reward, reward_details={"a": [1, 2]}) for j in range(2)]
    return Group(Prompt(uid, "1+1=", "2", {"k": 1}), trajs)


def test_round_trip_is_exact_and_a_torn_line_is_skipped(tmp_path):
    j = GroupJournal(tmp_path / "journal.jsonl", fresh=True)
    g = group("a", [0, 1])
    j.append(5, g)
    j.append(6, group("b", [1]))
    j.close()
    with (tmp_path / "journal.jsonl").open("a") as f:
        f.write('{"index": 7, "group": {"prom')  # the process died mid-write
    groups, discarded = GroupJournal(tmp_path / "journal.jsonl", fresh=False).reload(0, max_version=5)
    assert discarded == 0 and sorted(groups) == [5, 6]
    assert groups[5] == g  # floats, versions, details: all exact


def test_reload_keeps_untrained_groups_of_known_versions_only(tmp_path):
    path = tmp_path / "journal.jsonl"
    j = GroupJournal(path, fresh=True)
    j.append(3, group("trained", [1]))
    j.append(8, group("old", [1, 2]))
    j.append(9, group("newer_than_checkpoint", [2, 3]))
    j.append(10, group("first", [2]))
    j.append(10, group("again", [2]))  # the newest record of an index wins
    groups, discarded = j.reload(start=8, max_version=2)
    assert sorted(groups) == [8, 10] and discarded == 1
    assert groups[10].prompt.uid == "again"
    assert [json.loads(x)["index"] for x in path.read_text().splitlines()] == [8, 10]  # rewritten
    j.append(11, group("later", [2]))
    j.compact(10)
    assert [json.loads(x)["index"] for x in path.read_text().splitlines()] == [10, 11]
    assert GroupJournal(path, fresh=True).reload(0, 99) == ({}, 0)  # a fresh run starts empty


def _record_training(controller, trained: list):
    real = controller._train_step

    def train_step(step, groups):
        out = real(step, groups)  # raises on the interrupted step: not recorded
        trained.append((step, [g.prompt.uid for g in groups]))
        return out

    controller._train_step = train_step


def test_ctrl_c_in_async_mode_then_resume_trains_every_group_once_without_regenerating(tmp_path):
    out = tmp_path / "run"
    opts = ("system.mode=async", "rollout.max_staleness=1", "checkpoint_every=100", "max_steps=5")
    controller = prepare(tiny_cfg(tmp_path, *opts), out)
    trained: list = []
    _record_training(controller, trained)
    run_interrupted_at(controller, 2)
    p = controller.cfg.rollout.prompts_per_step
    assert [s for s, _ in trained] == [0, 1]
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)["state"]
    assert state["next_group"] == 2 * p, "the interrupted step's groups must not be skipped"
    journaled = {json.loads(x)["index"] for x in (out / "journal.jsonl").read_text().splitlines()}
    assert set(range(2 * p, 3 * p)) <= journaled and min(journaled) == 2 * p  # compacted at the checkpoint

    resumed = prepare(tiny_cfg(tmp_path, *opts), out, resume=True)
    _record_training(resumed, trained)
    generated: list[str] = []
    real_requests = resumed._requests
    resumed._requests = lambda prompts, step: generated.extend(q.uid for q in prompts) or real_requests(prompts, step)
    try:
        result = resumed.run()
    finally:
        close(resumed)
    assert result.steps == 5
    uids = [u for _, groups in trained for u in groups]
    assert [s for s, _ in trained] == [0, 1, 2, 3, 4]
    assert uids == [resumed.task.train_prompt(i).uid for i in range(5 * p)], "every group trained once, in order"
    reused = {resumed.task.train_prompt(i).uid for i in journaled}
    assert not reused & set(generated), "journaled groups must not be generated again"
    assert result.history[-1]["async/reloaded_groups"] == len(journaled)
    assert max(r["async/staleness_max"] for r in result.history if "async/staleness_max" in r) <= 1


def test_ctrl_c_before_the_first_step_resumes_without_a_second_base_eval(tmp_path):
    out = tmp_path / "run"
    opts = ("system.mode=async", "checkpoint_every=100", "max_steps=2")
    controller = prepare(tiny_cfg(tmp_path, *opts), out)
    run_interrupted_at(controller, 0)  # Ctrl-C in the first step
    resumed = prepare(tiny_cfg(tmp_path, *opts), out, resume=True)
    try:
        result = resumed.run()
    finally:
        close(resumed)
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert result.base_accuracy is not None and result.history[-1]["async/reloaded_groups"] > 0


def test_ctrl_c_after_a_step_trained_counts_that_step(tmp_path):
    """Stopped between the optimizer step and the end of the step (here: while publishing weights):
    the checkpoint counts the step, so its groups are not trained a second time after --resume, and its
    row is in metrics.jsonl (or the resumed run would leave a hole at that step)."""
    out = tmp_path / "run"
    opts = ("system.mode=async", "checkpoint_every=100", "max_steps=4")
    controller = prepare(tiny_cfg(tmp_path, *opts), out)
    real_update = controller.engine.request_weight_update

    def interrupt_publishing_version_2(state_dict, version):
        if version == 2:
            raise KeyboardInterrupt
        return real_update(state_dict, version)

    controller.engine.request_weight_update = interrupt_publishing_version_2
    try:
        with pytest.raises(KeyboardInterrupt):
            controller.run()
    finally:
        close(controller)
    p = controller.cfg.rollout.prompts_per_step
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)["state"]
    assert (state["step"], state["version"], state["next_group"]) == (2, 2, 2 * p)
    assert latest_checkpoint(out / "checkpoints").name == "step_2"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/mean" in rows[2]
    resumed = prepare(tiny_cfg(tmp_path, *opts), out, resume=True)
    trained: list = []
    _record_training(resumed, trained)
    try:
        resumed.run()
    finally:
        close(resumed)
    uids = [u for _, groups in trained for u in groups]
    assert uids == [resumed.task.train_prompt(i).uid for i in range(2 * p, 4 * p)]


def test_an_moe_samples_routes_round_trip(tmp_path):
    """``Trajectory.routes`` (uint8 [tokens, layers, k]) is journaled as ``moe.encode_routes`` writes it, not as
    the tensor's text, and comes back equal (issue 52)."""
    g = group("m", [0, 1])
    for t in g.trajectories:
        t.routes = torch.randint(0, 8, (len(t.prompt_ids) + t.num_tokens, 3, 2), dtype=torch.uint8)
        t.routes[-1] = 255
    j = GroupJournal(tmp_path / "journal.jsonl", fresh=True)
    j.append(0, g)
    j.close()
    groups, _ = GroupJournal(tmp_path / "journal.jsonl", fresh=False).reload(0, max_version=5)
    for a, b in zip(groups[0].trajectories, g.trajectories, strict=True):
        assert a.routes.dtype == torch.uint8 and torch.equal(a.routes, b.routes)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
