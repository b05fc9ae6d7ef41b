"""Controller semantics on a tiny model: eta=0 async == sync, resume == uninterrupted, bounds hold."""

import json

import pytest
import torch

from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import close, prepare, train

COMPARABLE = ("reward/", "algo/", "train/", "eval/", "rollout/response", "async/staleness")


def TINY_OVERRIDES(tmp_path):  # noqa: N802  (a constant list, parametrized by the cache dir)
    return [
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null",
        "sft.batch_size=16", f"sft.cache_dir={tmp_path / 'cache'}",
        "reward.name=digit_match", "reward.num_workers=0", "rollout.group_size=4", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=4", "max_steps=4", "max_time_s=null", "target_accuracy=null", "eval_every=2",
        "num_eval=16", "checkpoint_every=2", "optim.lr=1e-2", "system.num_threads=1",
        "log.progress=false", "log.tensorboard=false", "log.report=false",
        # Many tests stop a run with max_steps=2 and extend it with --resume to compare with an uninterrupted
        # run: a decay over max_steps (the default) would differ between the two, so the recipe's cosine keeps
        # a fixed length here (its max_steps, 400). test_the_lr_schedule_follows_max_steps tests the default.
        "optim.decay_steps=400"]

RUN_LENGTH_DECAY = "optim.decay_steps=max_steps"
"""The default decay (over the run's ``max_steps``), which ``TINY_OVERRIDES`` replaces by a fixed length."""


def tiny_cfg(tmp_path, *extra):
    return apply_overrides(RECIPES.get("quickstart_grpo")(), [*TINY_OVERRIDES(tmp_path), *extra])


def comparable(history):
    return [{k: v for k, v in row.items() if k == "step" or k.startswith(COMPARABLE)} for row in history]


def params(controller):
    return {k: v.clone() for k, v in controller.trainer.model.state_dict().items()}


def run(cfg, out, resume=False):
    controller = prepare(cfg, out, resume=resume)
    try:
        result = controller.run()
    finally:
        controller.tracker.close()
    return controller, result


def run_interrupted_at(controller, version: int) -> None:
    """Run ``controller`` and press Ctrl-C in the trainer step that would make ``version`` + 1 (a
    KeyboardInterrupt inside the step, where a user's Ctrl-C lands in a long step); closes the controller."""
    real_step = controller.trainer.step

    def interrupt(batch):
        if controller.trainer.version == version:
            raise KeyboardInterrupt
        return real_step(batch)

    controller.trainer.step = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            controller.run()
    finally:
        close(controller)


def run_stopped_after(steps, cfg, out):
    """``run``, stopped after ``steps`` steps (checkpointed) as a preempted run is: the config, and with it the
    learning-rate schedule over ``max_steps``, stays the run's."""
    controller = prepare(cfg, out)
    finish = controller._finish_step
    controller._finish_step = lambda step, *a: finish(step, *a) or ("stopped" if step + 1 == steps else None)
    try:
        result = controller.run()
    finally:
        controller.tracker.close()
    assert result.steps == steps
    return controller, result


def test_async_with_zero_staleness_equals_sync(tmp_path):
    sync_c, sync_r = run(tiny_cfg(tmp_path, "system.mode=sync"), tmp_path / "sync")
    async_c, async_r = run(tiny_cfg(tmp_path, "system.mode=async", "rollout.max_staleness=0"), tmp_path / "async")
    assert comparable(sync_r.history) == comparable(async_r.history)
    a, b = params(sync_c), params(async_c)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(row.get("train/grad_norm", 0) > 0 for row in sync_r.history), "the test must actually train"


def test_resume_equals_uninterrupted(tmp_path):
    full_c, full_r = run(tiny_cfg(tmp_path, "system.mode=sync"), tmp_path / "full")
    run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=2"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, "system.mode=sync"), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert comparable(rows) == comparable(full_r.history)
    a, b = params(full_c), params(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_keeps_the_lr_schedule_over_max_steps(tmp_path):
    """A run stopped after step 2 (as a preempted one) and resumed with the same config is the uninterrupted
    run, its learning rate included, with the default decay over ``max_steps`` (the recipe's cosine)."""
    opts = ("system.mode=sync", RUN_LENGTH_DECAY)
    full_c, full_r = run(tiny_cfg(tmp_path, *opts), tmp_path / "full")
    run_stopped_after(2, tiny_cfg(tmp_path, *opts), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *opts), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert comparable(rows) == comparable(full_r.history) and any("train/lr" in r for r in rows)
    a, b = params(full_c), params(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_lr_schedule_follows_max_steps(tmp_path):
    """Issue 49: ``--set max_steps=N`` on a recipe whose lr decays (quickstart's cosine) rescales the decay, which
    ends on the run's last optimizer step (N x ``trainer.num_minibatches``), the critic's too; the saved config
    keeps ``max_steps``, so a copy of it with another length rescales again; a number is kept."""
    runs = [("max_steps=3",), ("max_steps=7", "trainer.num_minibatches=2", "algo.advantage=gae",
                                "critic.optim.schedule=linear", "optim.warmup_steps=3"),
            ("max_steps=5", "optim.decay_steps=20")]
    for i, overrides in enumerate(runs):
        controller = prepare(tiny_cfg(tmp_path, RUN_LENGTH_DECAY, *overrides), tmp_path / f"run{i}")
        try:
            cfg = controller.cfg
            trainers = [controller.trainer] + ([controller.trainer.critic] if controller.trainer.critic else [])
            for t, optim in zip(trainers, (cfg.optim, cfg.critic.optim)):
                floor, lrs = optim.min_lr_ratio * optim.lr, []
                for _ in range(25):
                    t.optimizer.step()  # no gradients: nothing moves, the schedule advances
                    t.scheduler.step()
                    lrs.append(t.scheduler.get_last_lr()[0])
                last = 20 if optim.decay_steps == 20 else cfg.max_steps * cfg.trainer.num_minibatches
                assert lrs[last - 1] == pytest.approx(floor) and lrs[last - 2] > floor * 1.001, (overrides, lrs)
            assert len(trainers) == (2 if i == 1 else 1)
            saved = (tmp_path / f"run{i}" / "config.yaml").read_text()
            assert ("decay_steps: 20" if i == 2 else "decay_steps: max_steps") in saved
        finally:
            close(controller)


@pytest.mark.parametrize("eta", [1, 2])
def test_async_respects_staleness_and_interrupts(tmp_path, eta):
    cfg = tiny_cfg(tmp_path, "system.mode=async", f"rollout.max_staleness={eta}", "max_steps=8",
                   "rollout.max_new_tokens=12")
    _, result = run(cfg, tmp_path / f"a{eta}")
    rows = [r for r in result.history if "async/staleness_max" in r]
    assert len(rows) == 8
    assert max(r["async/staleness_max"] for r in rows) <= eta
    assert result.base_accuracy is not None and result.final_accuracy is not None


def test_train_writes_the_contract_files(tmp_path):
    cfg = tiny_cfg(tmp_path, "log.report=true", "log.tensorboard=true", "max_steps=2")
    result = train(cfg, tmp_path / "run")
    out = tmp_path / "run"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, **{k: v for k, v in rows[0].items() if k.startswith("eval/")}}
    for key in ("reward/mean", "perf/gen_tokens_per_s", "async/staleness_mean", "async/staleness_max"):
        assert key in rows[1], key
    assert (out / "config.yaml").exists() and (out / "report.html").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    assert result.steps == 2
