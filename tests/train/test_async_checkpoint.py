"""Asynchronous checkpoints (``train/async_checkpoint.py``, ``train/snapshot.py``): the same bytes as a
synchronous save, the state of the moment ``save`` was called, one write in flight, retention that never
removes the newest complete checkpoint, a failed write reported on ``wait``, buffers reused between saves.

A background write is held at a known point with a tokenizer whose ``save_pretrained`` (the first file a
checkpoint writes) waits for an event: the test decides what happens while a write is in flight."""

import copy
import threading

import pytest
import torch

from tidal.models import lora
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.checkpoint import (
    CheckpointError,
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_hashes,
)


class GatedTokenizer:
    """The real tokenizer, whose ``save_pretrained`` first waits until the test opens the gate."""

    def __init__(self, tokenizer):
        self.tokenizer, self.gate, self.entered = tokenizer, threading.Event(), threading.Event()

    def save_pretrained(self, directory):
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.tokenizer.save_pretrained(directory)


def _trained(small_model, steps=2, lora_rank=0):
    torch.manual_seed(0)
    model = copy.deepcopy(small_model)
    if lora_rank:
        model = lora.wrap(model, lora.LoraConfig(rank=lora_rank))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for _ in range(steps):
        _step(model, opt, sched)
    return model, opt, sched


def _step(model, opt, sched):
    ids = torch.randint(0, 20, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


class Critic(torch.nn.Module):  # an extra component (as algo.advantage=gae's critic): state_dict only
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 1)


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_async_writes_the_same_bytes_as_a_synchronous_save(small_model, tokenizer, tmp_path, lora_rank):
    model, opt, sched = _trained(small_model, lora_rank=lora_rank)
    critic, state = Critic(), TrainingState(2, 2, 8, {"elapsed_s": 1.5, "curriculum": {"seen": [1, 2]}})
    torch.manual_seed(123)  # both saves record this RNG state
    sync = save_checkpoint(tmp_path / "sync", model, tokenizer, opt, sched, state, components={"critic": critic})
    torch.manual_seed(123)
    writer = AsyncCheckpointer()
    path = writer.save(tmp_path / "async", model, tokenizer, opt, sched, state, components={"critic": critic})
    writer.wait()
    assert path == tmp_path / "async" / "step_2" and latest_checkpoint(tmp_path / "async") == path
    a, b = _files(sync), _files(path)
    assert a.keys() == b.keys() and "hashes.json" in a
    assert [n for n in a if a[n] != b[n]] == []
    assert verify_hashes(path) == 3  # the weights (or adapters), trainer_state.pt, critic.pt
    if not lora_rank:  # tied embeddings stay written once, as from the live model
        from safetensors.torch import load_file
        assert "lm_head.weight" not in load_file(path / "model.safetensors")


def test_the_checkpoint_holds_the_state_of_the_moment_save_was_called(small_model, tokenizer, tmp_path):
    model, opt, sched = _trained(small_model)
    expected = save_checkpoint(tmp_path / "sync", model, tokenizer, opt, sched, TrainingState(2, 2, 0, {}))
    gated, writer = GatedTokenizer(tokenizer), AsyncCheckpointer()
    path = writer.save(tmp_path / "async", model, gated, opt, sched, TrainingState(2, 2, 0, {}))
    assert gated.entered.wait(60)
    for _ in range(2):  # training goes on while the write is held: weights, moments, lr all change
        _step(model, opt, sched)
    gated.gate.set()
    writer.wait()
    for name in ("model.safetensors", "trainer_state.pt"):
        assert (path / name).read_bytes() == (expected / name).read_bytes(), name
    fresh, fresh_opt, fresh_sched = _trained(small_model, steps=0)
    assert load_checkpoint(path, fresh, fresh_opt, fresh_sched).step == 2
    assert fresh_sched.last_epoch == 2 and sched.last_epoch == 4


def test_one_write_in_flight_and_retention_keeps_the_newest_complete_checkpoint(small_model, tokenizer, tmp_path):
    model, opt, sched = _trained(small_model)
    root, writer = tmp_path / "ckpt", AsyncCheckpointer()
    writer.save(root, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}), keep=1)
    writer.wait()
    gated = GatedTokenizer(tokenizer)
    writer.save(root, model, gated, opt, sched, TrainingState(2, 2, 0, {}), keep=1)
    assert gated.entered.wait(60) and writer.in_flight
    # keep=1 and step_2 in flight: step_1 is the newest complete checkpoint and stays, whole
    assert latest_checkpoint(root) == root / "step_1" and verify_hashes(root / "step_1") == 2
    assert sorted(p.name for p in root.iterdir()) == [".tmp_step_2", "latest", "step_1"]
    third = threading.Thread(target=writer.save, args=(root, model, tokenizer, opt, sched, TrainingState(3, 3, 0, {})),
                             kwargs={"keep": 1})
    third.start()
    third.join(0.5)
    assert third.is_alive(), "a second save must wait for the write in flight"
    assert not (root / ".tmp_step_3").exists() and not (root / "step_3").exists()
    gated.gate.set()
    third.join(60)
    writer.wait()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3"]
    assert latest_checkpoint(root) == root / "step_3" and verify_hashes(root / "step_3") == 2


def test_a_failed_background_write_is_raised_by_wait_and_keeps_the_previous_checkpoint(small_model, tokenizer,
                                                                                         tmp_path):
    model, opt, sched = _trained(small_model)
    root, writer = tmp_path / "ckpt", AsyncCheckpointer()
    writer.save(root, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    writer.wait()

    class Failing:
        def save_pretrained(self, directory):
            raise OSError(28, "No space left on device")

    writer.save(root, model, Failing(), opt, sched, TrainingState(2, 2, 0, {}))
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_2 \(OSError: .*No space left.*"
                                              r"the previous checkpoint .*step_1 is intact"):
        writer.wait()
    writer.wait()  # reported once
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]


def test_snapshot_buffers_are_reused_between_saves(small_model, tokenizer, tmp_path):
    model, opt, sched = _trained(small_model)
    writer = AsyncCheckpointer()
    writer.save(tmp_path, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    writer.wait()
    first = writer.buffers.bytes_allocated
    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once; fp32 weights + 2 moments
    assert first >= 3 * 4 * n_params
    _step(model, opt, sched)
    writer.save(tmp_path, model, tokenizer, opt, sched, TrainingState(2, 2, 0, {}))
    writer.wait()
    assert writer.buffers.bytes_allocated == first, "a second save of the same shapes allocated again"
    assert set(writer.timings) == {"wait_s", "snapshot_s", "write_s", "write_cpu_s"}


@pytest.mark.parametrize("thread_ran", [False, True])
def test_an_interrupt_inside_thread_start_leaves_wait_usable(small_model, tokenizer, tmp_path, monkeypatch,
                                                             thread_ran):
    """SIGTERM's handler raising inside ``Thread.start`` (CI flake: ``wait()`` then raised "cannot join thread
    before it is started"): a writer that never ran is nothing to wait for; one that did run is waited for
    and its checkpoint is whole."""
    model, opt, sched = _trained(small_model)
    root, writer = tmp_path / "ckpt", AsyncCheckpointer()
    start = threading.Thread.start

    def interrupted_start(self):
        if thread_ran:
            start(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        writer.save(root, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    monkeypatch.setattr(threading.Thread, "start", start)
    writer.wait()
    assert not writer.in_flight
    if thread_ran:
        assert latest_checkpoint(root) == root / "step_1" and verify_hashes(root / "step_1") == 2
    else:
        assert latest_checkpoint(root) is None


def test_an_interrupt_while_waiting_keeps_the_write_to_wait_for(small_model, tokenizer, tmp_path, monkeypatch):
    """Ctrl-C landing in ``wait``'s join (the next save waiting for the previous write) used to forget the
    thread: the interrupt's own checkpoint then started a second write beside the first (CI: FileExistsError
    on ``.tmp_step_2``). The write stays the one the next ``wait`` joins."""
    model, opt, sched = _trained(small_model)
    root, writer, gated = tmp_path / "ckpt", AsyncCheckpointer(), GatedTokenizer(tokenizer)
    writer.save(root, model, gated, opt, sched, TrainingState(2, 2, 0, {}))
    assert gated.entered.wait(60)
    join = threading.Thread.join
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        writer.wait()
    monkeypatch.setattr(threading.Thread, "join", join)
    assert writer.in_flight
    gated.gate.set()
    writer.wait()
    assert latest_checkpoint(root) == root / "step_2" and verify_hashes(root / "step_2") == 2


def test_two_writes_of_one_step_at_once_take_turns(small_model, tokenizer, tmp_path):
    """Two writes in one process never interleave (each would delete the other's ``.tmp_step_<k>``): the
    second waits for the first, and both leave a whole checkpoint."""
    model, opt, sched = _trained(small_model)
    root, gated = tmp_path / "ckpt", GatedTokenizer(tokenizer)
    first, second = AsyncCheckpointer(), AsyncCheckpointer()
    first.save(root, model, gated, opt, sched, TrainingState(2, 2, 0, {}))
    assert gated.entered.wait(60)
    second.save(root, model, tokenizer, opt, sched, TrainingState(2, 2, 0, {}))
    second._thread.join(0.5)
    assert second.in_flight, "the second write ran while the first was inside its .tmp_step_2"
    gated.gate.set()
    first.wait()
    second.wait()
    assert latest_checkpoint(root) == root / "step_2" and verify_hashes(root / "step_2") == 2
    assert not list(root.glob(".tmp_*"))
