"""``system.device`` / ``trainer.precision`` / ``rollout.dtype`` resolution: the names, the errors, the defaults."""

import pytest
import torch

from tidal.config import ConfigError
from tidal.types import TrainBatch
from tidal.utils.device import resolve_device, resolve_dtype, tensors_to


def test_auto_picks_cuda_only_when_present():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_cuda_is_one_line_naming_the_key(spec):
    with pytest.raises(ConfigError, match=r"^system\.device=.*torch sees no CUDA device.*system\.device=cpu") as e:
        resolve_device(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["gpu", "cuda0", "tpu", ""])
def test_unknown_device_names_the_choices(spec):
    with pytest.raises(ConfigError, match="system.device must be auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_dtypes_auto_is_bf16_on_cuda_fp32_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "trainer.precision") == torch.float32
    assert resolve_dtype("auto", cuda, "trainer.precision") == torch.bfloat16
    assert resolve_dtype("bf16", cpu, "rollout.dtype") == torch.bfloat16
    assert resolve_dtype("fp32", cuda, "rollout.dtype") == torch.float32
    with pytest.raises(ConfigError, match="rollout.dtype must be auto, fp32 or bf16, got 'fp16'"):
        resolve_dtype("fp16", cpu, "rollout.dtype")


def test_tensors_to_moves_every_tensor_field_and_keeps_the_rest():
    z = torch.zeros(2, 3)
    batch = TrainBatch(z.long(), z.long(), z, z, z.long(), torch.zeros(2).long(), torch.zeros(2))
    moved = tensors_to(batch, torch.device("meta"))
    assert all(getattr(moved, f).device.type == "meta" for f in ("input_ids_bt", "rewards_b", "versions_bt"))
    assert moved.teacher_logp_bt is None and batch.input_ids_bt.device.type == "cpu"
