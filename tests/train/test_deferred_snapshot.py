"""Deferred checkpoint snapshots (``AsyncCheckpointer(deferred=True)``, ``checkpoint_snapshot=deferred``): ``save``
returns before the host copy, the copy runs on the writer's thread, and every optimizer step waits for it, so the
checkpoint holds the state of the moment ``save`` was called, byte for byte what an immediate snapshot writes."""

import copy
import threading

import pytest
import torch

from tidal.config import ConfigError, apply_overrides
from tidal.recipes import RECIPES
from tidal.system.validate import validate_run_config
from tidal.train import async_checkpoint
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.checkpoint import TrainingState, latest_checkpoint, verify_hashes


def _trained(small_model):
    torch.manual_seed(0)
    model = copy.deepcopy(small_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    _step(model, opt, sched)
    return model, opt, sched


def _forward_backward(model):
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()


def _step(model, opt, sched, after_backward=None):
    _forward_backward(model)
    if after_backward is not None:
        after_backward.set()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_the_next_optimizer_step_waits_for_the_copy_and_the_checkpoint_is_the_saved_moment(
        small_model, tokenizer, tmp_path, monkeypatch):
    model, opt, sched = _trained(small_model)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    gate, copying = threading.Event(), threading.Event()
    to_host = async_checkpoint.to_host

    def held_copy(refs, buffers):
        copying.set()
        assert gate.wait(60)
        return to_host(refs, buffers)

    monkeypatch.setattr(async_checkpoint, "to_host", held_copy)
    writer = AsyncCheckpointer(deferred=True)
    writer.save(tmp_path, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    assert copying.wait(60)
    backward_done, stepped = threading.Event(), threading.Event()
    trainer = threading.Thread(target=lambda: (_step(model, opt, sched, backward_done), stepped.set()))
    trainer.start()
    assert backward_done.wait(60), "the forward and backward waited for the copy too"
    assert not stepped.wait(0.5), "the optimizer stepped while the snapshot was being copied"
    gate.set()
    trainer.join(60)
    assert stepped.is_set()
    writer.wait()
    assert writer.timings["step_wait_s"] > 0 and writer.timings["snapshot_s"] < 0.5
    path = latest_checkpoint(tmp_path)
    assert verify_hashes(path) == 2
    from safetensors.torch import load_file

    saved = load_file(path / "model.safetensors")
    assert all(torch.equal(saved[k], at_save[k]) for k in saved)  # the moment of the save, not after the step
    assert any(not torch.equal(saved[k], model.state_dict()[k]) for k in saved)


def test_deferred_and_immediate_write_the_same_bytes(small_model, tokenizer, tmp_path):
    model, opt, sched = _trained(small_model)
    now, later = AsyncCheckpointer(), AsyncCheckpointer(deferred=True)
    now.save(tmp_path / "now", model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    now.wait()
    later.save(tmp_path / "later", model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    _step(model, opt, sched)  # its optimizer step waits for the deferred copy
    later.wait()
    a, b = tmp_path / "now" / "step_1", tmp_path / "later" / "step_1"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    sa, sb = (torch.load(d / "trainer_state.pt", weights_only=False) for d in (a, b))
    assert sa["state"] == sb["state"] and sa["scheduler"] == sb["scheduler"]
    for i, entry in sa["optimizer"]["state"].items():
        assert all(torch.equal(v, sb["optimizer"]["state"][i][k]) for k, v in entry.items())


def test_a_writer_that_never_ran_leaves_no_step_waiting(small_model, tokenizer, tmp_path, monkeypatch):
    """An interrupt inside ``Thread.start`` (the writer never began): ``wait`` releases the steps."""
    model, opt, sched = _trained(small_model)
    writer = AsyncCheckpointer(deferred=True)
    start = threading.Thread.start

    def interrupted_start(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        writer.save(tmp_path, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    monkeypatch.setattr(threading.Thread, "start", start)
    writer.wait()
    done = threading.Thread(target=_step, args=(model, opt, sched))
    done.start()
    done.join(30)
    assert not done.is_alive(), "an optimizer step still waits for a copy that never ran"


@pytest.mark.parametrize("sets,message", [
    (["checkpoint_snapshot=later"], "checkpoint_snapshot must be now or deferred"),
    (["checkpoint_snapshot=deferred", "async_checkpoint=false"], "needs async_checkpoint=true"),
    (["checkpoint_snapshot=deferred", "trainer.data_parallel=elastic"], "outside an optimizer step"),
])
def test_what_deferred_cannot_do_is_one_error_naming_the_keys(sets, message):
    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), sets)
    with pytest.raises(ConfigError, match=message):
        validate_run_config(cfg)


def test_a_run_resumed_from_a_deferred_checkpoint_equals_the_uninterrupted_one(tmp_path):
    """Every step checkpointed with the copy deferred into the next step's work; resuming from step 2's checkpoint
    (written while step 3 trained) gives step 4's weights and metrics exactly."""
    import json
    import shutil

    from tests.system.test_controller import comparable, params, run, tiny_cfg

    sets = ("system.mode=sync", "checkpoint_every=1", "keep_checkpoints=0", "checkpoint_snapshot=deferred")
    full_c, full_r = run(tiny_cfg(tmp_path, *sets), tmp_path / "full")
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "full", split)
    for later in ("step_3", "step_4"):
        shutil.rmtree(split / "checkpoints" / later)
    (split / "checkpoints" / "latest").write_text("step_2")
    resumed_c, _ = run(tiny_cfg(tmp_path, *sets), split, resume=True)
    rows = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert comparable(rows) == comparable(full_r.history)
    a, b = params(full_c), params(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)
