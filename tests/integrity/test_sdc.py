"""SDC recording, replay and fault injection on a tiny trainer: exact fingerprints, bit-identical replay
on CPU, and every injected flip found at its own phase and layer."""

import copy

import pytest
import torch

from tests.train.test_trainer import _groups
from tidal.algo.config import AlgoConfig
from tidal.integrity.faults import Fault, FaultInjector, flip_bit
from tidal.integrity.replay import Replayer, take_snapshot
from tidal.integrity.sdc import (
    MASK64,
    StepRecorder,
    checksum,
    combine,
    first_mismatch,
    last_state,
    layer_of,
    layer_order,
    state_checksums,
)
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer


def test_checksum_by_hand():
    t = torch.tensor([1.0, -2.0, 0.5])
    words = torch.tensor([1.0, -2.0]).view(torch.int64).item()  # the first 8 bytes as one word
    tail = torch.tensor([0.5]).view(torch.int32).item()  # 4 bytes left over, added as an unsigned number
    bits, total, sumsq = checksum(t)
    assert bits == (words + tail) & MASK64
    assert total == pytest.approx(-0.5) and sumsq == pytest.approx(5.25)
    assert combine([MASK64, 1.0, 2.0], [3, 1.0, 1.0]) == [2, 2.0, 3.0]  # bits wrap mod 2^64


@pytest.mark.parametrize("bit", [0, 13, 23, 30, 31])
def test_every_single_bit_flip_changes_the_bits(bit):
    t = torch.randn(1001)
    before = checksum(t)
    old, new = flip_bit(t, 500, bit)
    assert old != new
    assert checksum(t)[0] != before[0]
    flip_bit(t, 500, bit)  # flipping back restores it exactly
    assert checksum(t) == before


def test_layer_names():
    assert layer_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert layer_of("model.norm.weight") == "model.norm"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"


@pytest.fixture
def setup(small_model, tokenizer):
    model = copy.deepcopy(small_model)
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=5))
    groups = _groups(engine, tokenizer, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    batch, _ = build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)
    return model, batch


def _trainer(model, minibatches=1):
    return Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(num_minibatches=minibatches))


@pytest.mark.parametrize("minibatches", [1, 2])
def test_replay_is_bit_identical_and_records_every_phase(setup, minibatches):
    model, batch = setup
    trainer = _trainer(model, minibatches)
    replayer = Replayer(trainer)
    recorder = StepRecorder(trainer)
    for step in (1, 2):
        snap = take_snapshot(trainer)
        recorder.begin_step(step)
        trainer.step(batch)
        record = recorder.end_step()
        assert len(record["segments"]) == minibatches
        seg = record["segments"][0]
        order = layer_order(model)
        assert list(seg["forward"]) == order[: len(seg["forward"])]  # embeddings, layers, final norm
        assert set(seg["backward"]) == {layer_of(n) for n, _ in model.named_parameters()}
        assert any(k.endswith("#state") for k in seg["optimizer"])
        # what the step left behind is what the next step starts from
        assert last_state(record) == state_checksums(model, trainer.optimizer)
        replayer.load_snapshot(snap)
        assert replayer.check(record, batch) is None, f"step {step} did not replay bit-identically"


def _inject_and_find(model, batch, fault):
    trainer = _trainer(model)
    replayer = Replayer(trainer)
    recorder = StepRecorder(trainer)
    injector = FaultInjector([fault])
    injector.attach(recorder)
    snap_before_weights = take_snapshot(trainer)  # the clean state, before an at-rest flip
    injector.before_step(1, trainer)
    recorder.begin_step(1)
    trainer.step(batch)
    record = recorder.end_step()
    assert fault.fired and fault.before != fault.after
    if fault.kind == "weight":  # at rest: the start state differs from the last clean one
        return first_mismatch(record, {"step": 1, "weights": state_checksums(*_clean(snap_before_weights, model)),
                                       "segments": record["segments"]}, layer_order(model))
    replayer.load_snapshot(snap_before_weights)
    return replayer.check(record, batch)


def _clean(snap, model):
    m = copy.deepcopy(model)
    m.load_state_dict(snap.model)
    opt = torch.optim.AdamW(m.parameters())
    return m, opt


@pytest.mark.parametrize("kind, target", [
    ("activation", "model.layers.1"),
    ("activation", "model.embed_tokens"),
    ("gradient", "model.layers.0.mlp.up_proj.weight"),
    ("optimizer_state", "model.layers.1.self_attn.q_proj.weight"),
    ("weight", "model.layers.1.mlp.down_proj.weight"),
])
@pytest.mark.parametrize("bit", [30, 3])  # an exponent bit (a huge value) and a low mantissa bit (tiny change)
def test_injected_flip_is_found_at_its_phase_and_layer(setup, kind, target, bit):
    model, batch = setup
    fault = Fault(kind, step=1, target=target, index=7, bit=bit)
    found = _inject_and_find(model, batch, fault)
    assert found is not None, f"{kind} flip of bit {bit} in {target} not detected"
    assert (found.phase, found.layer) == (fault.expected_phase, fault.expected_layer), found.describe()


def test_tolerance_mode_ignores_low_bits_but_not_large_changes():
    a = {"step": 1, "weights": {"l": [1, 1.0, 1.0]}, "segments": []}
    b = {"step": 1, "weights": {"l": [2, 1.0 + 1e-9, 1.0]}, "segments": []}
    assert first_mismatch(a, b, ["l"]).phase == "weights"  # exact: the bits differ
    assert first_mismatch(a, b, ["l"], rtol=1e-6) is None
    c = {"step": 1, "weights": {"l": [2, float("nan"), 1.0]}, "segments": []}
    assert first_mismatch(a, c, ["l"], rtol=1e-6) is not None


def test_a_fault_planned_for_a_step_that_trained_nothing_fires_at_the_next_step_that_trains(setup):
    model, batch = setup
    trainer = _trainer(model)
    recorder = StepRecorder(trainer)
    fault = Fault("gradient", step=2, target="model.layers.0.mlp.up_proj.weight", index=3, bit=30)
    injector = FaultInjector([fault])
    injector.attach(recorder)
    for step in (1, 4):  # steps 2 and 3 had no batch: the controller calls nothing for them
        injector.before_step(step, trainer)
        recorder.begin_step(step)
        trainer.step(batch)
        recorder.end_step()
        assert fault.fired == (step == 4)
    assert fault.fired_step == 4 and fault.step == 2


def test_result_changed_says_whether_the_step_left_a_different_state():
    seg = {"forward": {"l": [1, 1.0, 1.0]}, "backward": {"l": [5, 0.1, 0.01]}, "optimizer": {"l": [9, 2.0, 4.0]}}
    a = {"step": 3, "weights": {"l": [7, 2.0, 4.0]}, "segments": [seg]}
    absorbed = {**a, "segments": [{**seg, "forward": {"l": [2, 1.0, 1.0]}}]}  # a different activation, same update
    found = first_mismatch(a, absorbed, ["l"])
    assert (found.phase, found.result_changed) == ("forward", False)
    spread = {**a, "segments": [{**seg, "forward": {"l": [2, 1.0, 1.0]}, "optimizer": {"l": [8, 2.0, 4.0]}}]}
    found = first_mismatch(a, spread, ["l"])
    assert (found.phase, found.result_changed) == ("forward", True)


def test_an_exponent_flip_in_a_gradient_changes_the_result(setup):
    model, batch = setup
    found = _inject_and_find(model, batch, Fault("gradient", step=1, target="model.layers.0.mlp.up_proj.weight",
                                                 index=7, bit=30))
    assert found.phase == "backward" and found.result_changed
