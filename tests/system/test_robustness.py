"""A crash loses nothing: a failing verifier is counted, an interrupted run resumes cleanly."""

import json

import pytest

from tidal.rewards import register_fn
from tidal.system.run import prepare

from .test_controller import tiny_cfg


@register_fn("test_flaky")
def flaky_reward(response: str, prompt):
    if response.startswith("1"):
        raise ValueError("verifier bug")
    return float(len(response) % 2), {}


def test_a_raising_verifier_is_counted_and_the_run_goes_on(tmp_path):
    cfg = tiny_cfg(tmp_path, "reward.name=test_flaky", "system.mode=async")
    controller = prepare(cfg, tmp_path / "run")
    try:
        result = controller.run()
    finally:
        controller.tracker.close()
    assert result.steps == 4
    assert result.history[-1]["reward/errors"] > 0


def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path, monkeypatch):
    out = tmp_path / "run"
    controller = prepare(tiny_cfg(tmp_path, "system.mode=sync", "checkpoint_every=100"), out)
    real_step = controller.trainer.step

    def interrupt_on_third(batch):
        if controller.trainer.version == 2:
            raise KeyboardInterrupt
        return real_step(batch)

    monkeypatch.setattr(controller.trainer, "step", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    controller.tracker.close()
    assert (out / "checkpoints" / "latest").read_text() == "step_2"

    resumed = prepare(tiny_cfg(tmp_path, "system.mode=sync", "checkpoint_every=100"), out, resume=True)
    try:
        result = resumed.run()
    finally:
        resumed.tracker.close()
    assert result.steps == 4
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
