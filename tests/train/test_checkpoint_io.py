"""``checkpoint_io``: the large checkpoint files written past the page cache are the bytes the libraries write
(safetensors byte for byte, ``torch.load`` reads the state back), their digests are the files' own, and a
filesystem that refuses ``O_DIRECT`` gets the same file through the page cache."""

import errno
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.train import checkpoint_io
from tidal.train.checkpoint import file_digest


@pytest.fixture
def small_buffer(monkeypatch):
    """A 8 KiB staging buffer, so that a test file spans many buffer flushes and ends in a partial block."""
    monkeypatch.setattr(checkpoint_io, "BUFFER_BYTES", 8192)
    monkeypatch.setattr(checkpoint_io, "_BUFFER", None)
    yield
    checkpoint_io._BUFFER = None  # the next test allocates one of the real size


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(97, 33, generator=g),  # 12,804 bytes: two buffers and a partial block
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 7, generator=g).half(),
        "ids": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "f8": torch.ones(6).to(torch.float8_e4m3fn),
        "u8": torch.arange(9, dtype=torch.uint8),
        "c": torch.randn(2, generator=g, dtype=torch.complex64),
        "d": torch.randn(3, generator=g, dtype=torch.float64),
    }


def test_safetensors_bytes_match_save_file_and_the_digest_is_the_files(tmp_path, small_buffer):
    ts = tensors()
    save_file(ts, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    digests = {}
    checkpoint_io.save_safetensors(ts, tmp_path / "ours.safetensors", {"format": "pt"}, digests)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert digests == {os.path.abspath(tmp_path / "ours.safetensors"): file_digest(tmp_path / "ours.safetensors")}
    loaded = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ts.items() if v.dim())


def test_safetensors_refuses_what_save_file_refuses(tmp_path):
    w = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="share memory"):
        checkpoint_io.save_safetensors({"a": w, "b": w}, tmp_path / "x.safetensors")
    fused = torch.randn(2, 3, 4)  # an MoE's experts, saved as per-expert views: disjoint, so allowed
    checkpoint_io.save_safetensors({"e0": fused[0], "e1": fused[1]}, tmp_path / "x.safetensors")
    assert torch.equal(load_file(tmp_path / "x.safetensors")["e1"], fused[1])
    with pytest.raises(RuntimeError, match="share memory"):
        checkpoint_io.save_safetensors({"a": fused.view(-1)[:13], "b": fused.view(-1)[12:]}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="non contiguous"):
        checkpoint_io.save_safetensors({"a": w.t()}, tmp_path / "x.safetensors")


def test_torch_save_loads_back_with_its_digest(tmp_path, small_buffer):
    state = {"optimizer": {"state": {0: {"exp_avg": torch.randn(1000), "step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]}, "state": {"step": 7}}
    digest = checkpoint_io.torch_save(state, tmp_path / "trainer_state.pt")
    assert digest == file_digest(tmp_path / "trainer_state.pt")
    for mmap in (False, True):
        back = torch.load(tmp_path / "trainer_state.pt", weights_only=False, mmap=mmap)
        assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
        assert back["state"] == {"step": 7}
    assert torch.serialization.get_crc32_options()  # restored for everyone else's torch.save


def test_a_filesystem_that_refuses_o_direct_gets_the_page_cache(tmp_path, monkeypatch, small_buffer):
    """At open (tmpfs before Linux 6.6) or at the first write (some FUSE filesystems): the same bytes either way."""
    data = os.urandom(20_000)
    real_open, real_write = os.open, os.write

    def no_direct_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    with checkpoint_io.HashingWriter(tmp_path / "a.bin") as f:
        f.write(data)
    assert not f.direct and (tmp_path / "a.bin").read_bytes() == data
    monkeypatch.setattr(os, "open", real_open)

    direct_fds = set()

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        else:  # the descriptor number of a closed direct file, reused
            direct_fds.discard(fd)
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "write", refusing_write)
    with checkpoint_io.HashingWriter(tmp_path / "b.bin") as f:
        f.write(data)
    assert not f.direct and (tmp_path / "b.bin").read_bytes() == data
    assert f.digest == file_digest(tmp_path / "b.bin")


def test_an_empty_file(tmp_path):
    with checkpoint_io.HashingWriter(tmp_path / "empty") as f:
        pass
    assert (tmp_path / "empty").read_bytes() == b"" and f.digest == file_digest(tmp_path / "empty")


def test_a_checkpoint_loads_in_transformers_and_verifies(tmp_path):
    """The whole write path: ``from_pretrained`` reads the weights, ``load_checkpoint`` the rest, hashes checked."""
    from transformers import AutoModelForCausalLM

    from tidal.models import tiny
    from tidal.train.checkpoint import TrainingState, load_checkpoint, save_checkpoint, verify_hashes

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              intermediate_size=64), tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(0, 10, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    path = save_checkpoint(tmp_path, model, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    assert verify_hashes(path) == 2
    again = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    assert load_checkpoint(path, again, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)).step == 1
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
