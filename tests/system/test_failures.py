"""A run whose every group fails stops with one line (issue 50 item 7), and an evaluation whose every episode
failed is an error, not accuracy 0.0 (system/failures.py, rollout/evaluate.py)."""

import json

import pytest

from tidal.api import AllFailed
from tidal.cli import main
from tidal.rewards import register_fn
from tidal.system.failures import FailedSteps
from tidal.system.run import prepare
from tidal.types import Group, Prompt, Trajectory

from .test_controller import TINY_OVERRIDES, tiny_cfg


@register_fn("test_raises_on_train")
def raises_on_train(response: str, prompt):
    """Raises on every training prompt (``train-N``) and scores held-out ones: training fails, evaluation works."""
    if prompt.uid.startswith("train-"):
        raise ZeroDivisionError("reward bug")
    return float(response.strip() == prompt.answer), {}


@register_fn("test_always_raises")
def always_raises(response: str, prompt):
    raise ZeroDivisionError("reward bug")


def _traj(failure: str | None = None, reward: float = 0.0) -> Trajectory:
    episode = None if failure is None else {"infra_failure": failure}
    return Trajectory(prompt_uid="p", sample_index=0, prompt_ids=[1], token_ids=[], logprobs=[], versions=[],
                      finish_reason="stop", text="", reward=reward, episode=episode)


def test_failed_steps_count_only_consecutive_steps_whose_every_group_failed():
    watch = FailedSteps(3)
    empty = Group(Prompt("a", "1+1=", "2"), [])  # every episode crashed: left out of the group
    errored = Group(Prompt("b", "1+1=", "2"), [_traj(reward=0.0)])
    errored.trajectories[0].reward_details = {"error": "ZeroDivisionError: x"}
    healthy = Group(Prompt("c", "1+1=", "2"), [_traj(reward=1.0)])
    watch.note([_traj("the agent raised EpisodeFailed: reward\nraised")])
    for step, drawn in enumerate([[empty, errored], [empty], [empty, healthy], [errored], [empty]], start=1):
        watch.observe(drawn)
        watch.check(step)  # a healthy group at step 3 restarts the count: 2 in a row by step 5
    assert watch.streak == 2
    watch.observe([empty, empty])
    with pytest.raises(AllFailed, match=r"last 3 steps failed \(steps 4-6, 4 groups.*last: the agent raised "
                                        r"EpisodeFailed: reward raised\).*max_failed_steps=3") as e:
        watch.check(6)
    assert "\n" not in str(e.value)


def test_a_run_whose_every_group_fails_stops_after_max_failed_steps(tmp_path):
    """Every training sample's reward raises (the held-out ones score): before, the run trained nothing to
    max_steps and returned "reached max_steps"; now it stops after 3 steps, logged and checkpointed."""
    cfg = tiny_cfg(tmp_path, "reward.name=test_raises_on_train", "system.mode=sync", "max_steps=20")
    controller = prepare(cfg, tmp_path / "run")
    try:
        with pytest.raises(AllFailed, match=r"every group of the last 3 steps failed .*ZeroDivisionError: reward bug"):
            controller.run()
    finally:
        controller.tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["algo/failed_groups"] == 4 for r in rows[1:])
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()


def test_an_evaluation_whose_every_episode_failed_stops_the_run_at_step_0(tmp_path, capsys):
    """`tidal train` with a reward that always raises: one line, exit 1, before any step (not a base accuracy of
    0.0 and 20 steps of nothing); `tidal eval` of the same says so too."""
    sets = [*TINY_OVERRIDES(tmp_path), "reward.name=test_always_raises", "max_steps=20"]
    argv = ["train", "quickstart_grpo", "--out", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the held-out evaluation at step 0: every one of its 16 episodes failed"), err
    assert "ZeroDivisionError: reward bug" in err[-1]
    from tidal.models import tiny

    tok = tiny.build_tokenizer()
    small = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    tiny.save(tiny.build_model(small, tok), tok, tmp_path / "model")
    assert main(["eval", str(tmp_path / "model"), "--set", "reward.name=test_always_raises",
                 "--set", "reward.num_workers=0", "--set", "num_eval=8", "--set", "rollout.max_new_tokens=4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the held-out evaluation: every one of its 8 episodes failed"), err


def test_max_failed_steps_is_checked(tmp_path):
    from tidal.config import ConfigError
    from tidal.system.run import check_inputs

    with pytest.raises(ConfigError, match="max_failed_steps"):
        check_inputs(tiny_cfg(tmp_path, "max_failed_steps=0"))
