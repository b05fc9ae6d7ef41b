"""Deterministic replay of training steps on a shadow trainer, compared with what was recorded.

The shadow is a deep copy of the live ``Trainer`` made before any hook is attached (so it has the same
model class, optimizer, scheduler, loss and micro-batching, and none of the live run's recorders or
faults), with its own ``StepRecorder``. It is loaded with a state from before the step, runs
``Trainer.step`` on the same ``TrainBatch``, and its record is compared with the original
(``sdc.first_mismatch``): the first (phase, layer) that differs is where the corruption entered.

Two sources of the "before" state:

- a ``Snapshot`` taken in memory at the start of a sampled step (``sdc.replay_every``): costs a copy
  of the weights and optimizer state, and one extra step of compute per replayed step;
- a checkpoint (``checkpoint.py``, content hashes checked on load) plus the batches of the steps
  since, saved per step (``save_batch``): used on an anomaly, it replays every step from the
  checkpoint on and finds the *first* bad one even when the anomaly showed up steps later.

Cost in memory: one more copy of the model, its optimizer state (and the reference model, if any).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.integrity.sdc import Mismatch, StepRecorder, first_mismatch, layer_order
from tidal.train.checkpoint import load_checkpoint
from tidal.types import BatchImages, TrainBatch
from tidal.utils.seeding import rng_state, set_rng_state


@dataclass
class Snapshot:
    """A trainer's state at the start of a step, held in memory."""

    model: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    version: int


def take_snapshot(trainer) -> Snapshot:
    return Snapshot({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                    copy.deepcopy(trainer.optimizer.state_dict()), copy.deepcopy(trainer.scheduler.state_dict()),
                    trainer.version)


def save_batch(batch: TrainBatch, path: Path) -> None:
    """Write one step's TrainBatch (its tensors by field name), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if batch.images is not None:  # a vision-language batch: its images as plain tensors and lists (weights_only)
        fields["images"] = dataclasses.asdict(batch.images)
    torch.save(fields, tmp)
    tmp.replace(path)


def load_batch(path: Path) -> TrainBatch:
    fields = torch.load(path, weights_only=True)
    if fields.get("images") is not None:
        fields["images"] = BatchImages(**fields["images"])
    return TrainBatch(**fields)


class Replayer:
    """Replays steps on a shadow copy of ``trainer`` (build it before attaching any hook to ``trainer``)."""

    def __init__(self, trainer, rank: int = 0):
        assert not trainer.observers, "build the Replayer before attaching recorders or faults to the trainer"
        assert not trainer.dp.enabled, "replay runs on a 1-process trainer (an FSDP step needs every rank)"
        self.shadow = copy.deepcopy(trainer)
        self.recorder = StepRecorder(self.shadow, rank)
        self.order = layer_order(self.shadow.model)

    def load_snapshot(self, snap: Snapshot) -> None:
        self.shadow.model.load_state_dict(snap.model)
        self.shadow.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        self.shadow.scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
        self.shadow.version = snap.version

    def load_checkpoint(self, path: str | Path) -> int:
        """Load a checkpoint (hashes verified) into the shadow; returns its step. The process's RNG state,
        which a checkpoint load restores, is put back: replay must not disturb the live run."""
        saved = rng_state()
        try:
            return load_checkpoint(path, self.shadow.model, self.shadow.optimizer, self.shadow.scheduler,
                                   components=self.shadow._components()).step
        finally:
            set_rng_state(saved)

    def run(self, step: int, batch: TrainBatch) -> dict[str, Any]:
        """Train the shadow one step on ``batch``, recording it as step ``step``; returns the record."""
        self.recorder.begin_step(step)
        try:
            with warnings.catch_warnings():  # the copied scheduler no longer sees its optimizer's step wrapper
                warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)` has been overridden")
                self.shadow.step(batch)
        finally:
            record = self.recorder.end_step()
        return record

    def check(self, original: dict[str, Any], batch: TrainBatch, rtol: float = 0.0) -> Mismatch | None:
        """Replay ``original``'s step on ``batch`` from the shadow's current state and compare."""
        return first_mismatch(original, self.run(original["step"], batch), self.order, rtol)

    def check_from_checkpoint(self, path: str | Path, records: dict[int, dict], batches: dict[int, Path],
                              upto: int, rtol: float = 0.0) -> tuple[Mismatch | None, int]:
        """Load checkpoint ``path`` (step s) and replay steps s+1..``upto`` from their saved batches,
        comparing each with its record; returns (the first mismatch or None, steps replayed). A step
        with no record or no batch (a skipped step) is replayed as a skip."""
        start = self.load_checkpoint(path)
        replayed = 0
        for k in range(start + 1, upto + 1):
            if k not in batches or k not in records:
                self.shadow.skip_step()
                continue
            found = self.check(records[k], load_batch(batches[k]), rtol)
            replayed += 1
            if found is not None:
                return found, replayed
        return None, replayed
