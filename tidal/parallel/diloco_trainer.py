"""The RL trainer's data-parallel ranks as DiLoCo workers (``trainer.data_parallel=diloco``), not FSDP.

Under torchrun every rank holds a full replica of the policy and its own inner optimizer (a plain
1-process ``Trainer``), and every H inner steps the ranks exchange pseudo-gradients through torchft
(``diloco.py``: average of theta_global - theta_w over the live workers, outer Nesterov SGD). Between
syncs nothing is communicated: no FSDP all-gather, no gradient reduce-scatter.

What each rank trains on, and its denominators. Every rank still receives the whole TrainBatch (rank 0
announces it, as in FSDP mode) and keeps its share of the groups, the same split FSDP uses
(``DataParallel.part``: whole groups, balanced by tokens). It then runs ``Trainer.step`` on that
sub-batch exactly as one process would on a batch of those rows: advantages (including the batch- and
minibatch-scoped ones), the loss aggregation's denominator D (tokens, sequences or groups), VCPO's ESS
and every metric come from *its own rows only*. That is the right normalization for DiLoCo: a worker is
an independent trainer between syncs, its inner AdamW step is the step of a trainer whose batch is its
share, and the outer step averages whole displacements, not gradients, so there is no global sum that
a global denominator would have to make exact (FSDP mode needs global D because its gradients are
summed into one update). Group-scoped advantages (GRPO, Dr. GRPO, ...) are unchanged by the split since
groups never straddle ranks; batch-scoped ones are normalized over the worker's share.

Keeping the rounds aligned. torchft counts inner *optimizer* steps (``diloco.sync_every`` = H of them;
``trainer.num_minibatches`` per trainer step). A worker whose share forms fewer minibatches than the
whole batch does (or has no group at all: fewer groups than ranks) takes empty inner steps after its
real ones (no gradient: AdamW leaves every parameter alone; the lr schedule advances) so every rank
reaches each sync at the same trainer step.

Which weights the run uses. The rollout and eval engines get rank 0's replica as it is now
(``state_dict_for_engine``): between syncs that is one worker's local policy, right after a sync the
global one. This is DiLoCo's natural semantics: workers act on their local parameters between rounds.
Checkpoints are rank 0's replica, inner optimizer and scheduler in the 1-process layout, written by rank
0 alone; every rank resumes from them (so a run may resume on a different number of processes, or one).
Lost on resume: the other replicas' drift since the last sync and the outer Nesterov momentum (the
first round after a resume seeds it afresh, as round one does).

Silent data corruption. The 1-process SDC guard (recording, replay) is off under torchrun
(``launch/torchrun.py``); what DiLoCo gives instead is a moment when every replica must hold the
same weights: right after a round that synced the whole model (one fragment, no local mix-in, the sync on
the trainer step's last inner step), every worker has applied the same averaged pseudo-gradient with the
same outer optimizer to the same global parameters. So after each such round the ranks all-gather a
fingerprint per layer (``sdc.param_checksums``; a few int64s per layer over the default group) and a rank
whose layer differs from the others' is named in a warning (``elastic_dp.disagreeing_ranks``) and counted
in ``diloco/replica_mismatches``. It catches a flip in a replica's weights or outer state that survived
to the sync; a flip in one worker's inner steps is averaged into everyone's update alike (replay needs
that worker's own rows) and is not found this way.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack

import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.integrity.sdc import param_checksums
from tidal.parallel.diloco import DiLoCoConfig, diloco_worker
from tidal.parallel.elastic_dp import disagreeing_ranks, fingerprint_row
from tidal.parallel.fsdp import DataParallel
from tidal.train.critic import check_supported
from tidal.train.trainer import Trainer, minibatches
from tidal.types import BatchImages, TrainBatch

log = logging.getLogger(__name__)


def rows_of(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The TrainBatch made of ``rows`` (positions, in order) of ``batch``; optional fields that are None
    (``teacher_logp_bt`` outside distillation) stay None, and a vision-language batch's images follow its rows."""
    index = torch.tensor(rows, dtype=torch.long)
    return TrainBatch(**{f.name: None if (v := getattr(batch, f.name)) is None else
                         v.rows(index) if isinstance(v, BatchImages) else v[index] for f in dataclasses.fields(batch)})


def broadcast_weights(model: torch.nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's (DiLoCo starts all workers from one theta;
    torchft runs with ``init_sync=False``). Collective over the default process group."""
    with torch.no_grad():
        for t in model.state_dict().values():  # tied weights appear twice: a second, identical broadcast
            dist.broadcast(t, src=0)


class DiLoCoTrainer:
    """A full-replica ``Trainer`` (built with no data parallel) run as one DiLoCo worker of the ranks'
    group. Same interface as ``Trainer`` for the controller and ``LeaderTrainer``/``follow``."""

    def __init__(self, trainer: Trainer, cfg: DiLoCoConfig, dp: DataParallel, lighthouse_addr: str):
        assert not trainer.dp.enabled, "a DiLoCo worker's trainer is a plain 1-process trainer (no FSDP)"
        if trainer.cfg.weights != "fp32":  # the outer step reads and writes the parameters, not the masters
            raise ConfigError(f"trainer.weights={trainer.cfg.weights} with trainer.data_parallel=diloco: DiLoCo's "
                              "outer step averages the model's parameters, not the float32 masters; use "
                              "trainer.weights=fp32")
        if trainer.critic is not None:  # each replica would train its own critic, never synced
            check_supported(trainer.cfg, data_parallel=True)
        self.trainer = trainer
        self.dp = dp
        self.cfg = cfg
        self.inner_steps = 0
        """Inner optimizer steps since this worker joined (torchft's DiLoCo counts from 0 there too)."""
        self.incidents: list[dict] = []
        self._stack = ExitStack()
        self.manager, self.stats = self._stack.enter_context(
            diloco_worker(trainer.model, trainer.optimizer, cfg, lighthouse_addr, f"rank{dp.rank}"))

    # the controller checkpoints and reads these directly: rank 0's replica
    model = property(lambda self: self.trainer.model)
    ref_model = property(lambda self: self.trainer.ref_model)
    optimizer = property(lambda self: self.trainer.optimizer)
    scheduler = property(lambda self: self.trainer.scheduler)
    version = property(lambda self: self.trainer.version)
    weight_sync_metrics = property(lambda self: self.trainer.weight_sync_metrics)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One inner trainer step on this rank's groups of ``batch`` (every rank is handed the same batch)."""
        num_chunks = len(minibatches(batch.group_index_b, self.trainer.cfg.num_minibatches))
        mine = self.dp.part(batch.group_index_b.tolist(), batch.attention_mask_bt.sum(-1).tolist())
        done, metrics = 0, {}
        if mine:
            sub = rows_of(batch, mine)
            done = len(minibatches(sub.group_index_b, self.trainer.cfg.num_minibatches))
            metrics = self.trainer.step(sub)
        else:
            self.trainer.skip_step()  # versions count trainer steps on every rank
        for _ in range(num_chunks - done):  # empty inner steps: torchft counts optimizer steps
            self.trainer.optimizer.zero_grad(set_to_none=True)
            self.trainer.optimizer.step()
            self.trainer.scheduler.step()
        self.inner_steps += num_chunks
        if self.inner_steps % self.cfg.sync_every == 0 and self.whole_model_syncs():
            self.compare_replicas()
        metrics["perf/diloco_bytes"] = float(self.stats.bytes_sent)
        metrics["perf/diloco_syncs"] = float(self.manager.current_step())
        metrics["diloco/replica_mismatches"] = float(len(self.incidents))
        return metrics

    def whole_model_syncs(self) -> bool:
        """Whether a round leaves every worker with the global weights exactly (module docstring)."""
        return self.cfg.num_fragments == 1 and self.cfg.fragment_update_alpha == 0.0

    def compare_replicas(self) -> None:
        """After a whole-model sync: every rank's per-layer fingerprint of its weights, gathered; a rank that
        disagrees is reported. Skipped when a round had fewer participants than ranks (one left behind
        legitimately holds other weights). Collective: every rank calls it at the same step."""
        sums = param_checksums(self.trainer.model)
        keys = sorted(sums)
        bits = torch.zeros(self.dp.world_size, len(keys), dtype=torch.long)
        bits[self.dp.rank] = fingerprint_row(sums, keys)
        self.dp.sum_(bits)  # a sum of one-hot rows: the gathered table
        if self.manager.num_participants() != self.dp.world_size:
            return
        round_ = self.manager.current_step()
        for found in disagreeing_ranks(bits, keys):
            incident = {"round": round_, **found}
            self.incidents.append(incident)
            log.warning("silent data corruption on a DiLoCo worker: after round %d, the weights of %s differ on "
                        "rank(s) %s%s", round_, found["entry"], found["ranks"],
                        " (two-way tie: either side)" if found["ambiguous"] else "")

    def skip_step(self) -> None:
        self.trainer.skip_step()

    def state_dict_for_engine(self, quant: str = "none", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Rank 0's current replica for the rollout engine (the other ranks have no engine: empty dict)."""
        return self.trainer.state_dict_for_engine(quant, dtype) if self.dp.rank == 0 else {}

    def save_checkpoint(self, *args, **kwargs):
        return self.trainer.save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, path):
        return self.trainer.load_checkpoint(path)

    def close(self) -> None:
        """Leave the torchft group (the last sync is already done: it runs inside ``step``). Idempotent."""
        self._stack.close()
