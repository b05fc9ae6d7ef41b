"""The SDC guard in a real run: a flipped bit is found at its step, phase and layer, the run rolls back
to the last verified checkpoint and ends with exactly the fault-free run's weights."""

import json
import math

import pytest
import torch

from tests.system.test_controller import params, tiny_cfg
from tidal.integrity.faults import Fault
from tidal.integrity.guard import SDC_FILE, rollback, worker_mismatch
from tidal.system.run import prepare, train
from tidal.train.checkpoint import CheckpointCorrupted, load_checkpoint
from tidal.types import Group, Prompt, TrainBatch, Trajectory

SETTINGS = ("system.mode=sync", "max_steps=5", "checkpoint_every=2", "keep_checkpoints=3", "eval_every=5")


def _incidents(out):
    path = out / "sdc" / "incidents.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _final_params(cfg, out, faults=None):
    train(cfg, out, faults=faults)
    controller = prepare(cfg, out, resume=True)  # the last checkpoint, as a later --resume would see it
    try:
        return params(controller)
    finally:
        controller.tracker.close()


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    cfg = tiny_cfg(tmp, *SETTINGS, "sdc.replay_every=1")
    return tmp, cfg, _final_params(cfg, tmp / "run")


def test_a_clean_run_records_every_step_and_finds_nothing(clean):
    tmp, _, _ = clean
    out = tmp / "run"
    records = [json.loads(x) for x in (out / SDC_FILE).read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "train/loss" in r]  # a step with no informative group trains nothing
    assert len(trained) >= 3 and [r["step"] for r in records] == trained
    assert all(r["segments"][0]["forward"] and r["segments"][0]["backward"] for r in records)
    assert _incidents(out) == []
    assert [r["sdc/replayed_steps"] for r in rows if "sdc/replayed_steps" in r] == list(range(1, len(trained) + 1))
    marker = json.loads((out / "checkpoints" / "step_4" / "sdc.json").read_text())
    assert marker == {"step": 4, "verified": True}


@pytest.mark.parametrize("fault, extra, how", [
    (Fault("activation", step=3, target="model.layers.0", index=11, bit=4), ["sdc.replay_every=1"], "sampled"),
    (Fault("gradient", step=3, target="model.layers.0.mlp.up_proj.weight", index=5, bit=30),
     ["sdc.replay_every=0"], "anomaly"),
    (Fault("weight", step=3, target="model.layers.0.self_attn.v_proj.weight", index=3, bit=2),
     ["sdc.replay_every=0", "sdc.replay_on_anomaly=false"], "at-rest"),
])
def test_flip_is_localised_rolled_back_and_the_run_ends_as_the_clean_one(clean, tmp_path, fault, extra, how):
    tmp, _, clean_params = clean
    cfg = tiny_cfg(tmp, *SETTINGS, *extra)
    out = tmp_path / "faulty"
    got = _final_params(cfg, out, faults=[fault])
    assert fault.fired
    [incident] = _incidents(out)
    assert how in incident["how"]
    assert (incident["step"], incident["phase"], incident["layer"], incident["rank"]) == (
        3, fault.expected_phase, fault.expected_layer, 0), incident["message"]
    assert incident["detected_at_step"] == 3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # steps 3.. were trained again, logged once
    assert all(torch.equal(got[k], clean_params[k]) for k in got), "the rolled-back run must equal the clean one"


def test_rollback_without_a_checkpoint_starts_from_the_base(clean, tmp_path):
    tmp, _, clean_params = clean
    cfg = tiny_cfg(tmp, *SETTINGS, "sdc.replay_every=1")
    fault = Fault("optimizer_state", step=1, target="model.layers.0.mlp.down_proj.weight", index=2, bit=20)
    got = _final_params(cfg, tmp_path / "early", faults=[fault])
    [incident] = _incidents(tmp_path / "early")
    assert (incident["phase"], incident["layer"]) == ("optimizer", "model.layers.0#state")
    assert all(torch.equal(got[k], clean_params[k]) for k in got)


def test_rollback_picks_the_newest_usable_checkpoint_before_the_bad_step(clean, tmp_path):
    import shutil

    tmp, _, _ = clean
    out = tmp_path / "copy"
    shutil.copytree(tmp / "run", out)
    (out / "checkpoints" / "step_2" / "model.safetensors").write_bytes(b"corrupted")
    assert rollback(out, bad_step=5) == 4  # 4 < 5, hashes fine; step_5 (the final save) quarantined
    assert rollback(out, bad_step=3) is None  # step_2 fails its hash check; nothing earlier
    assert sorted(p.name.split("_")[1] for p in (out / "checkpoints" / "quarantine").iterdir()) == ["2", "4", "5"]


def test_a_corrupted_checkpoint_file_is_named_on_load(clean, tmp_path):
    import shutil

    tmp, _, _ = clean
    ckpt = tmp_path / "ck"
    shutil.copytree(tmp / "run" / "checkpoints" / "step_4", ckpt)
    data = bytearray((ckpt / "trainer_state.pt").read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit on disk
    (ckpt / "trainer_state.pt").write_bytes(bytes(data))
    controller = prepare(tiny_cfg(tmp, *SETTINGS), tmp_path / "x")
    try:
        trainer = controller.trainer
        with pytest.raises(CheckpointCorrupted, match="trainer_state.pt is corrupted"):
            load_checkpoint(ckpt, trainer.model, trainer.optimizer, trainer.scheduler)
    finally:
        controller.tracker.close()


def _traj(uid, j, worker, logprobs, versions):
    return Trajectory(uid, j, [5], [6] * len(logprobs), logprobs, versions, "stop", worker=worker)


def test_worker_mismatch_by_hand():
    groups = [Group(Prompt("a", "a", "1"),
                    [_traj("a", 0, 0, [-1.0, -2.0], [3, 3]), _traj("a", 1, 1, [-1.0, -1.0], [3, 2])])]
    # rows: [prompt, tok, tok]; trainer log-probs differ by 0.1, 0.3 on row 0 and by 0.5, 9 on row 1
    batch = TrainBatch(torch.tensor([[5, 6, 6], [5, 6, 6]]), torch.ones(2, 3, dtype=torch.long),
                       torch.tensor([[0.0, 1, 1], [0, 1, 1]]), torch.tensor([[0.0, -1, -2], [0, -1, -1]]),
                       torch.tensor([[-1, 3, 3], [-1, 3, 2]]), torch.tensor([0, 0]), torch.tensor([1.0, 0.0]))
    logp = torch.tensor([[0.0, -1.1, -1.7], [0.0, -0.5, 8.0]])
    gaps = worker_mismatch(groups, batch, logp, version=3)
    assert gaps[0] == pytest.approx(0.2) and gaps[1] == pytest.approx(0.5)  # worker 1's stale token left out
    batch.behav_logp_bt[:, 0] = -math.inf  # padding (the prompt column) may hold -inf: the gaps do not change
    assert worker_mismatch(groups, batch, logp, version=3) == gaps


@pytest.mark.parametrize("setting, match", [("sdc.replay_every=-1", "sdc.replay_every must be >= 0"),
                                            ("sdc.spike_factor=1", "sdc.spike_factor must be > 1")])
def test_bad_sdc_settings_name_the_key(tmp_path, setting, match):
    from tidal.config import ConfigError
    from tidal.system.validate import validate_run_config

    with pytest.raises(ConfigError, match=match):
        validate_run_config(tiny_cfg(tmp_path, setting))


def test_a_flip_before_the_first_step_is_found_at_rest(clean, tmp_path):
    """No step has run yet: the reference is the state as loaded (the base model)."""
    tmp, _, clean_params = clean
    cfg = tiny_cfg(tmp, *SETTINGS, "sdc.replay_every=1")
    fault = Fault("weight", step=1, target="model.layers.0.mlp.gate_proj.weight", index=9, bit=25)
    got = _final_params(cfg, tmp_path / "faulty", faults=[fault])
    [incident] = _incidents(tmp_path / "faulty")
    assert (incident["step"], incident["phase"], incident["layer"]) == (fault.fired_step, "weights", "model.layers.0")
    assert "at-rest" in incident["how"]
    assert all(torch.equal(got[k], clean_params[k]) for k in got)
