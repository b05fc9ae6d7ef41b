"""Where a run's tensors live and in which precision: ``system.device``, ``trainer.precision``, ``rollout.dtype``.

One code path for every device (DESIGN.md, "Devices"): the policy, reference, critic, optimizer state and
the local engine are placed on ``system.device``; reward workers stay CPU processes. ``auto`` picks CUDA
when torch sees a GPU, so a CPU machine runs exactly as before and a GPU machine needs no flag.

Precision is a setting, not a fork. ``bf16`` for the trainer means bf16 autocast around the forward with
float32 master weights and optimizer state (mixed precision, Micikevicius et al. 2018, arXiv 1710.03740);
the LM head and log-softmax stay float32 either way (``models/logprobs.py``, MiniMax-M1 sec. 3.2). For the
rollout engine it is the dtype of its own copy of the weights and of its KV cache, as vLLM serves in bf16:
the engine/trainer numeric gap this opens shows in ``train/logp_mismatch_*`` and is what the TIS/MIS
corrections (``algo.correction``) are for. ``auto`` is bf16 on CUDA (every GPU we target has bf16 matrix
units) and float32 on CPU (most CPUs have no bf16 arithmetic: FACTS.md measured TRL 10x slower with it).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tidal.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(spec: str | torch.device, key: str = "system.device") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` as a ``torch.device``; a CUDA request without CUDA (or an
    index past the visible GPUs) is a ``ConfigError`` naming ``key``. Under torchrun (``LOCAL_RANK`` set),
    ``auto`` and ``cuda`` take the rank's own GPU."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    name = str(spec).strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={spec}: torch sees no CUDA device (torch {torch.__version__}, "
                              f"cuda build {torch.version.cuda}); use {key}=cpu or {key}=auto")
        index = name.partition(":")[2]
        if not index:
            index = os.environ.get("LOCAL_RANK", "0")
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise ConfigError(f"{key}={spec}: there are {torch.cuda.device_count()} visible CUDA devices "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", int(index))
    raise ConfigError(f"{key} must be auto, cpu, cuda or cuda:N, got {spec!r}")


def resolve_dtype(spec: str, device: torch.device, key: str) -> torch.dtype:
    """``auto`` | ``fp32`` | ``bf16`` as a torch dtype on ``device`` (``auto``: bf16 on CUDA, else fp32)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise ConfigError(f"{key} must be auto, fp32 or bf16, got {spec!r}")
    return DTYPES[spec]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (the whole model lives on one device here)."""
    return next(model.parameters()).device


def tensors_to(obj, device: torch.device):
    """A copy of dataclass ``obj`` with every tensor field moved to ``device`` (one transfer per tensor;
    ``non_blocking`` from pinned memory is not worth it at these sizes). Non-tensor fields are shared."""
    moved = {f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
             if isinstance(getattr(obj, f.name), torch.Tensor)}
    return dataclasses.replace(obj, **moved)
