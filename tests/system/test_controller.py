"""Controller semantics on a tiny model: eta=0 async == sync, resume == uninterrupted, bounds hold."""

import json

import pytest
import torch

from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import prepare, train

COMPARABLE = ("reward/", "algo/", "train/", "eval/", "rollout/response", "async/staleness")


def TINY_OVERRIDES(tmp_path):  # noqa: N802  (a constant list, parametrized by the cache dir)
    return [
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null",
        "sft.batch_size=16", f"sft.cache_dir={tmp_path / 'cache'}",
        "reward.name=digit_match", "reward.num_workers=0", "rollout.group_size=4", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=4", "max_steps=4", "max_time_s=null", "target_accuracy=null", "eval_every=2",
        "num_eval=16", "checkpoint_every=2", "optim.lr=1e-2", "system.num_threads=1",
        "log.progress=false", "log.tensorboard=false", "log.report=false"]


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
