"""The run's silent-data-corruption guard: record every step, replay some, roll back on a mismatch.

Gemini 2.5's split-phase SDC detection (Google, 2025 tech report): cheap per-step checksums, a
deterministic replay of sampled or suspicious steps, and a rollback to the last good state. Here
(``integrity/sdc.py`` for the fingerprints, ``integrity/replay.py`` for the replay):

1. *Record* (``sdc.record``, on by default): per-layer fingerprints of the state at rest, the forward
   outputs, the gradients and the updated state of every step, one JSON line per step in
   ``RUN_DIR/sdc.jsonl``; each step's TrainBatch is kept in ``RUN_DIR/sdc/batches/`` back to the oldest
   kept checkpoint (the "journaled batch" a replay needs).
2. *At rest*: a step's start state must equal what the previous step left (its last ``optimizer``
   entry; for the run's first step, the state as loaded when the guard was built); checked at no extra
   cost, it finds memory corruption between steps at once.
3. *Replay*: every ``sdc.replay_every`` steps the step is replayed on a shadow trainer from an in-memory
   snapshot taken as it started; on an *anomaly* (a non-finite loss or gradient norm, or one more than
   ``sdc.spike_factor`` x its recent median) the steps since the newest kept checkpoint are replayed
   from it (then from the older one), which finds the first bad step even when the anomaly came later.
4. *Rollback*: a mismatch is written to ``RUN_DIR/sdc/incidents.jsonl`` (step, rank, phase, layer)
   and, with ``sdc.rollback``, raised as ``SilentDataCorruption``; ``run.train`` then moves the
   checkpoints from the bad step on into ``checkpoints/quarantine/`` and resumes from the newest
   checkpoint before it whose content hashes check and whose state matched its step's record when it
   was written (``sdc.json`` inside it). No such checkpoint: the run starts again from the base model.

5. *Rollout side* (``rollout_check``): the trainer's log-probs of the tokens each rollout worker sampled
   with the current weights, against that worker's behaviour log-probs. A worker whose mean gap is above
   ``sdc.rollout_mismatch_floor`` and ``sdc.rollout_mismatch_factor`` x the other workers' median (one
   worker: x its own recent median) is flagged: a warning names it, ``sdc/rollout_flagged_workers``
   counts it. It does not stop the run (the correction already weighs those tokens; a bad engine
   replica is the operator's to replace).

Scope: a 1-process trainer (FSDP and DiLoCo ranks are not recorded: a replay of an FSDP step needs
every rank; ``launch/torchrun.py`` turns the guard off). The critic of ``algo.advantage=gae`` is
not fingerprinted.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.integrity.faults import Fault, FaultInjector
from tidal.integrity.replay import Replayer, save_batch, take_snapshot
from tidal.integrity.sdc import Mismatch, StepRecorder, compare_entries, last_state, layer_order, state_checksums
from tidal.train.checkpoint import CheckpointCorrupted, _steps, verify_hashes
from tidal.types import Group, TrainBatch

log = logging.getLogger(__name__)


@dataclass
class SDCConfig:
    """Silent-data-corruption detection (docs/faults.md)."""

    record: bool = True
    """Record per-layer fingerprints of every training step (``RUN_DIR/sdc.jsonl``) and check the state at
    rest between steps. Measured overhead: see docs/faults.md (``tidal bench faults``)."""
    replay_every: int = 50
    """Replay one step in this many on a shadow trainer and compare (0: never). Each replay costs one
    extra step of compute (2% at 50) plus a copy of the weights and optimizer state."""
    replay_on_anomaly: bool = True
    """On an anomalous step (non-finite or spiking loss / gradient norm), replay the steps since the
    newest kept checkpoint from it. Keeps every step's batch back to the oldest kept checkpoint."""
    spike_factor: float = 10.0
    """An anomaly: |train/loss| or train/grad_norm above this many times its median over the last
    ``spike_window`` steps (after 5 steps of history)."""
    spike_window: int = 20
    """Steps of history the spike test's median looks at."""
    rtol: float = 0.0
    """0: a replay must match bit for bit (same process, same threads: CPU kernels are deterministic).
    > 0: compare the float sums with this relative tolerance instead (replay on another machine kind
    or thread count, where reduction order changes the low bits)."""
    rollback: bool = True
    """On a detected corruption, roll back to the last verified checkpoint and continue."""
    max_rollbacks: int = 3
    """Give up (raise) after this many rollbacks in one ``tidal train``: a fault that keeps coming back
    is a broken machine, not a transient flip."""
    rollout_mismatch_factor: float = 10.0
    """Flag a rollout worker whose engine/trainer log-prob gap is this many times the others' median."""
    rollout_mismatch_floor: float = 1e-3
    """...and above this absolute mean gap (CPU numerics give ~1e-6; fp8 weights ~1e-2: raise it then)."""

    def __post_init__(self):
        for key in ("replay_every", "spike_window", "max_rollbacks"):
            if getattr(self, key) < 0:
                raise ValueError(f"sdc.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("spike_factor", "rollout_mismatch_factor"):
            if getattr(self, key) <= 1.0:
                raise ValueError(f"sdc.{key} must be > 1, got {getattr(self, key)}")
        if self.rtol < 0 or self.rollout_mismatch_floor < 0:
            raise ValueError("sdc.rtol and sdc.rollout_mismatch_floor must be >= 0")


class SilentDataCorruption(RuntimeError):
    """A replay or the at-rest check found a corrupted step; ``incident`` says where."""

    def __init__(self, incident: dict[str, Any]):
        self.incident = incident
        super().__init__(incident["message"])


SDC_FILE = "sdc.jsonl"
VERIFIED = "sdc.json"


def _read_records(path: Path) -> dict[int, dict]:
    records: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                records[int(r["step"])] = r
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash
    return records


class SDCGuard:
    """Records, checks and replays the steps of one controller's trainer (see the module docstring)."""

    def __init__(self, cfg: SDCConfig, trainer, run_dir: str | Path, start_step: int,
                 faults: list[Fault] | None = None):
        self.cfg = cfg
        self.trainer = trainer
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / SDC_FILE
        self.batch_dir = self.run_dir / "sdc" / "batches"
        self.incidents_path = self.run_dir / "sdc" / "incidents.jsonl"
        self.ckpt_root = self.run_dir / "checkpoints"
        self.enabled = cfg.record and not trainer.dp.enabled
        self.num_replayed = 0
        self.num_flagged_workers = 0
        self.flagged_workers: set = set()
        self.replay_s = 0.0
        self._history: deque = deque(maxlen=max(cfg.spike_window, 1))
        self._worker_history: dict[Any, deque] = {}
        self._snapshot = None
        self._last_state = None
        self.replayer = self.recorder = self.injector = None
        if not self.enabled:
            return
        wants_replay = cfg.replay_every > 0 or cfg.replay_on_anomaly
        self.replayer = Replayer(trainer) if wants_replay else None  # before any hook is attached
        self.recorder = StepRecorder(trainer)
        if faults:
            self.injector = FaultInjector(faults)
            self.injector.attach(self.recorder)
        self._truncate(start_step)
        if self._last_state is None:  # no record of the step we start from: the state as loaded is the reference,
            self._last_state = state_checksums(trainer.model, trainer.optimizer)  # so step 1 is checked at rest too
        self.order = layer_order(trainer.model)

    def _truncate(self, start_step: int) -> None:
        """A resumed (or rolled-back) run continues from ``start_step``: later records and batches belong to
        a history it does not share."""
        records = _read_records(self.path)
        kept = {k: r for k, r in records.items() if k <= start_step}
        if len(kept) != len(records):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(kept[k]) + "\n" for k in sorted(kept)))
            tmp.replace(self.path)
        elif start_step == 0 and self.path.exists():
            self.path.unlink()
        for p in self.batch_dir.glob("step_*.pt"):
            if int(p.stem.split("_")[1]) > start_step:
                p.unlink()
        if start_step in kept:
            self._last_state = last_state(kept[start_step])

    # ---- per step --------------------------------------------------------------------------------
    def before_step(self, step: int, batch: TrainBatch) -> None:
        """Step ``step`` is about to train ``batch``: check the state at rest, keep the batch, snapshot."""
        if not self.enabled:
            return
        if self.injector is not None:
            self.injector.before_step(step, self.trainer)
        weights = self.recorder.begin_step(step)
        if self._last_state is not None:
            key = compare_entries(self._last_state, weights, self.order, 0.0)
            if key is not None:  # the state changed while nothing was computing: memory corruption
                try:
                    self._incident(Mismatch(step, self.recorder.rank, "weights", key, 0, self._last_state.get(key),
                                            weights.get(key)), "at-rest check")
                except SilentDataCorruption:
                    self.recorder.end_step()
                    raise
        if self.cfg.replay_on_anomaly:
            save_batch(batch, self.batch_dir / f"step_{step}.pt")
        if self.cfg.replay_every and step % self.cfg.replay_every == 0:
            self._snapshot = take_snapshot(self.trainer)

    def after_step(self, step: int, batch: TrainBatch, metrics: dict[str, float]) -> dict[str, float]:
        """Write the step's record; replay it if sampled or anomalous. Raises SilentDataCorruption."""
        if not self.enabled:
            return {}
        record = self.recorder.end_step()
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._last_state = last_state(record)
        anomaly = self._anomaly(metrics)
        found, how, t0 = None, "", time.perf_counter()
        if self._snapshot is not None:
            self.replayer.load_snapshot(self._snapshot)
            self._snapshot = None
            found, how = self.replayer.check(record, batch, self.cfg.rtol), "sampled replay"
            self.num_replayed += 1
        if found is None and anomaly and self.cfg.replay_on_anomaly:
            found, how = self._replay_from_checkpoints(step), f"replay after anomaly at step {step}"
        self.replay_s += time.perf_counter() - t0
        out = {"sdc/anomaly": float(anomaly), "sdc/replayed_steps": float(self.num_replayed),
               "sdc/replay_s": self.replay_s}
        if found is not None:
            self._incident(found, how, detected_at=step)
        return out

    def _anomaly(self, metrics: dict[str, float]) -> bool:
        loss, norm = abs(metrics.get("train/loss", 0.0)), metrics.get("train/grad_norm", 0.0)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return True
        spike = False
        if len(self._history) >= 5:
            med_loss = statistics.median(h[0] for h in self._history)
            med_norm = statistics.median(h[1] for h in self._history)
            spike = (loss > self.cfg.spike_factor * med_loss > 0) or (norm > self.cfg.spike_factor * med_norm > 0)
        if not spike:  # a spike stays out of the baseline it is judged against
            self._history.append((loss, norm))
        return spike

    def _replay_from_checkpoints(self, step: int) -> Mismatch | None:
        """Replay from the newest usable checkpoint, then older ones, up to ``step``."""
        records = _read_records(self.path)
        batches = {int(p.stem.split("_")[1]): p for p in self.batch_dir.glob("step_*.pt")}
        for start in sorted((k for k in _steps(self.ckpt_root) if k < step), reverse=True):
            path = self.ckpt_root / f"step_{start}"
            if not _usable(path):
                continue
            if any(k not in batches for k in range(start + 1, step + 1) if k in records):
                continue  # its batches were pruned
            found, n = self.replayer.check_from_checkpoint(path, records, batches, step, self.cfg.rtol)
            self.num_replayed += n
            if found is not None:
                return found
        return None

    def _incident(self, found: Mismatch, how: str, detected_at: int | None = None) -> None:
        detected_at = found.step if detected_at is None else detected_at
        incident = {**asdict(found), "detected_at_step": detected_at, "how": how, "time": time.time(),
                    "message": f"silent data corruption ({how}): {found.describe()}"}
        self.incidents_path.parent.mkdir(parents=True, exist_ok=True)
        with self.incidents_path.open("a") as f:
            f.write(json.dumps(incident) + "\n")
        log.warning(incident["message"])
        if self.cfg.rollback:
            raise SilentDataCorruption(incident)

    # ---- checkpoints ----------------------------------------------------------------------------
    def on_checkpoint(self, path: Path | None, step: int) -> None:
        """Mark checkpoint ``path`` (of ``step``) verified if the state it saved is the state step ``step``
        recorded; drop batches no kept checkpoint can need."""
        if not self.enabled or path is None:
            return
        verified = self._last_state is not None and compare_entries(
            self._last_state, state_checksums(self.trainer.model, self.trainer.optimizer), self.order) is None
        (Path(path) / VERIFIED).write_text(json.dumps({"step": step, "verified": verified}) + "\n")
        kept = _steps(self.ckpt_root)
        if kept:
            for p in self.batch_dir.glob("step_*.pt"):
                if int(p.stem.split("_")[1]) <= min(kept):
                    p.unlink()

    # ---- rollout side ---------------------------------------------------------------------------
    def rollout_check(self, groups: list[Group], batch: TrainBatch | None, logp_bt: torch.Tensor | None,
                      version: int) -> dict[str, float]:
        """Flag rollout workers whose behaviour log-probs are out of band (see the module docstring)."""
        if batch is None or logp_bt is None:
            return {}
        gaps = worker_mismatch(groups, batch, logp_bt, version)
        if not gaps:
            return {}
        flagged = []
        for worker, gap in gaps.items():
            others = [g for w, g in gaps.items() if w != worker]
            own = self._worker_history.setdefault(worker, deque(maxlen=max(self.cfg.spike_window, 1)))
            ref = statistics.median(others) if others else statistics.median(own) if own else None
            if ref is not None and gap > max(self.cfg.rollout_mismatch_floor, self.cfg.rollout_mismatch_factor * ref):
                flagged.append(worker)
                log.warning("rollout worker %s is out of band: mean |trainer - behaviour| log-prob %.3g on its "
                            "tokens sampled by version %d, %.3g elsewhere (a faulty engine replica?)",
                            worker, gap, version, ref)
            else:
                own.append(gap)
        self.flagged_workers.update(flagged)
        return {"sdc/rollout_mismatch_worst": max(gaps.values()), "sdc/rollout_flagged_workers": float(len(flagged))}

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def worker_mismatch(groups: list[Group], batch: TrainBatch, logp_bt: torch.Tensor, version: int) -> dict[Any, float]:
    """Mean |trainer log-prob - behaviour log-prob| per rollout worker (``Trajectory.worker``; None: the
    run's one engine) over the trained tokens that ``version`` sampled. Rows map to trajectories as
    ``build_train_batch`` lays them out: a group's samples are consecutive, in order."""
    first_row: dict[int, int] = {}
    for row, gi in enumerate(batch.group_index_b.tolist()):
        first_row.setdefault(gi, row)
    logp_bt = logp_bt.to(batch.behav_logp_bt.device)  # the trainer's device; the batch as the controller built it
    fresh_bt = batch.loss_mask_bt * (batch.versions_bt == version)
    # a selection, not a product: a padded log-prob may be -inf, and 0 * inf would make the worker's sum NaN
    gap_bt = torch.where(fresh_bt > 0, (logp_bt - batch.behav_logp_bt).abs(), 0.0) * fresh_bt
    sums: dict[Any, list[float]] = {}
    for gi, row in first_row.items():
        for j, t in enumerate(groups[gi].trajectories):
            s = sums.setdefault(t.worker, [0.0, 0.0])
            s[0] += float(gap_bt[row + j].sum())
            s[1] += float(fresh_bt[row + j].sum())
    return {w: s / n for w, (s, n) in sums.items() if n > 0}


def _usable(path: Path) -> bool:
    """A checkpoint a rollback may resume from: its hashes check and it was not marked unverified."""
    try:
        verify_hashes(path)
    except CheckpointCorrupted as e:
        log.warning("%s", e)
        return False
    marker = path / VERIFIED
    return not marker.exists() or json.loads(marker.read_text()).get("verified", False)


def rollback(run_dir: str | Path, bad_step: int) -> int | None:
    """Quarantine the checkpoints from ``bad_step`` on (and unusable ones), point ``latest`` at the newest
    usable checkpoint before it, return its step; None when none is left (start again from the base)."""
    root = Path(run_dir) / "checkpoints"
    quarantine = root / "quarantine"
    chosen = None
    for k in sorted(_steps(root), reverse=True):
        path = root / f"step_{k}"
        if chosen is None and k < bad_step and _usable(path):
            chosen = k
            continue
        if chosen is None:  # after the bad step, or unusable: never resumed from
            quarantine.mkdir(parents=True, exist_ok=True)
            dest = quarantine / f"step_{k}_{int(time.time() * 1000)}"
            shutil.move(str(path), dest)
    if chosen is None:
        (root / "latest").unlink(missing_ok=True)
        return None
    (root / "latest.tmp").write_text(f"step_{chosen}")
    (root / "latest.tmp").replace(root / "latest")
    return chosen
