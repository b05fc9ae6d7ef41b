"""Checkpoints: everything needed to continue a run exactly where it stopped.

``checkpoints/step_<k>/`` holds the policy (``save_pretrained``, safetensors, loadable by any HF
tool), the tokenizer, and ``trainer_state.pt``: optimizer and scheduler state, RNG states, the
policy version, the step and the data position. A checkpoint is written to a temporary directory
and renamed into place, and ``latest`` is updated last, so a crash mid-save leaves the previous
checkpoint intact. Older checkpoints beyond ``keep`` are removed.

A model sharded with FSDP (``distributed.py``) is saved as full weights and full optimizer state
gathered on rank 0, in the same files and numbering as one process writes, so a run can resume with
a different number of processes; loading one broadcasts it from rank 0 into every rank's shards.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.train import distributed
from tidal.utils.seeding import rng_state, set_rng_state


@dataclass
class TrainingState:
    """Counters that locate a run in its data and in policy-version space."""

    step: int  # training steps completed
    version: int  # policy version of the saved weights
    next_group: int  # index of the first group (prompt) not yet trained on
    extra: dict[str, Any]


def save_checkpoint(
    root: str | Path, model, tokenizer, optimizer, scheduler, state: TrainingState, keep: int = 2
) -> Path | None:
    """Write ``step_<k>/``. A sharded model: every rank takes part in the gather and rank 0 writes
    (the others get None)."""
    model_state_dict = optimizer_state = None
    if distributed.root_of(model) is not None:
        model_state_dict, optimizer_state = distributed.gather_full_state(model, optimizer)
        if distributed.rank() != 0:
            return None
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step}"
    tmp = root / f".tmp_step_{state.step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state_dict)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "state": state.__dict__,
        },
        tmp / "trainer_state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / "latest.tmp").write_text(final.name)
    (root / "latest.tmp").replace(root / "latest")
    for old in sorted(_steps(root))[:-keep] if keep > 0 else []:
        shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return final


def _steps(root: Path) -> list[int]:
    return [int(p.name.split("_", 1)[1]) for p in root.glob("step_*") if p.name.split("_", 1)[1].isdigit()]


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "trainer_state.pt").exists():
            return path
    steps = sorted(_steps(root))
    return root / f"step_{steps[-1]}" if steps else None


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> TrainingState:
    """Load weights, optimizer, scheduler and RNG state in place; return the counters. A sharded model:
    every rank calls it, rank 0 reads the files."""
    if distributed.root_of(model) is not None:
        return distributed.load_full_checkpoint(path, model, optimizer, scheduler)
    weights, blob = read_checkpoint(path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing means a different architecture.
    missing = [k for k in missing if k not in ("lm_head.weight",)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    return TrainingState(**blob["state"])


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, trainer state blob) of a checkpoint directory."""
    from safetensors.torch import load_file

    path = Path(path)
    return load_file(path / "model.safetensors"), torch.load(path / "trainer_state.pt", weights_only=False)
