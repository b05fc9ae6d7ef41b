"""Elastic data parallel for the RL ``Trainer``: full replicas whose gradients are summed over torchft.

``parallel/elastic.py`` is a standalone elastic loop on a supervised loss; this module makes the RL trainer
itself elastic. Each replica holds a whole, unsharded ``Trainer`` built with an ``ElasticDP`` in place of
the FSDP ``DataParallel``. ``ElasticDP`` has the same five collectives the trainer already calls in FSDP
mode (``part``, ``max_int``, ``sum_``, ``sum_floats``, ``reduce_gradients``), but its rank and world size
are the *current torchft quorum's* (participating rank, number of participants), and every collective is
a torchft ``Manager.allreduce`` (a process group rebuilt each quorum, so a dead peer fails the step
instead of hanging the job).

Exact per-token normalisation on any world size. The trainer computes the advantages and the loss
aggregation's denominators (tokens, sequences or groups of the whole minibatch) on every replica from
the whole batch *before* the split (``distributed.py``), each replica sums loss x weight over its own
whole groups, and ``reduce_gradients`` *sums* the replicas' gradients: the update is the 1-process
update whether 3, 2 or 1 replicas are alive (the test compares against a 1-process trainer).

One step (``ElasticTrainer.step``): ``start_quorum`` (a replica that has just (re)started heals there:
torchft copies a live peer's state into it and it jumps to the quorum's step), snapshot the trainer's
state (weights, optimizer, scheduler, version), run ``Trainer.step``, then ``should_commit``. If a peer died
during the step its all-reduce failed, every survivor gets False, restores the snapshot and runs the same
batch again on the next, smaller quorum. Cost: one in-memory copy of the trainer state per step.

How a user runs it: ``tidal train RECIPE --set trainer.data_parallel=elastic`` (``ElasticConfig`` below).
The run's process (the leader, ``parallel/elastic_leader.py``) is replica 0: controller, generation, rewards,
eval and checkpoints, plus its own ``ElasticTrainer``; it spawns the other replicas
(``parallel/elastic_replica.py``), hands each batch down a pipe per replica (a dead replica breaks only its own
pipe) and restarts a replica whose process ended; the new process heals from a live peer here and rejoins.
Tested with real processes both here (``tests/parallel/test_elastic_dp.py``: exact update, heal, SDC check) and
through the command (``tests/launch/test_elastic.py``); see docs/faults.md.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from tidal.integrity.sdc import MASK64, state_checksums
from tidal.parallel.replica_group import LOOPBACK, replica_group
from tidal.train.data_parallel import ElasticConfig, split_groups, validate_elastic  # noqa: F401 (keys beside the trainer)
from tidal.types import TrainBatch

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_MS = 2000
"""A replica that has not heartbeaten (every 100 ms, from a torchft thread) for this long is dead to the
lighthouse: the next quorum forms without it."""


class ElasticDP:
    """The trainer's data-parallel collectives over a torchft ``Manager`` (see the module docstring).
    Valid between ``manager.start_quorum()`` and ``manager.should_commit()``."""

    shards_model = False
    """Full replicas: the trainer does not shard; ``reduce_gradients`` sums the gradients."""
    device = torch.device("cpu")

    def __init__(self, manager):
        self.manager = manager

    @property
    def rank(self) -> int:
        r = self.manager.participating_rank()
        return 0 if r is None else r

    @property
    def world_size(self) -> int:
        return max(self.manager.num_participants(), 1)

    @property
    def enabled(self) -> bool:
        return True  # even alone: the collectives stay paired with the peers of the quorum

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed import ReduceOp

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def part(self, group_index_b: Sequence[int], lengths_b: Sequence[int]) -> list[int]:
        """This replica's rows: whole groups, balanced by tokens over the quorum's participants."""
        return split_groups(group_index_b, lengths_b, self.world_size)[self.rank]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self._sum(t)

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """[world, n]: row r is participant r's ``values`` (a sum of one-hot rows: only all-reduce needed)."""
        out = torch.zeros(self.world_size, *values.shape, dtype=values.dtype)
        out[self.rank] = values
        return self._sum(out)

    def max_int(self, n: int) -> int:
        if self.manager.errored() is not None:
            return n  # a failed step: its result is thrown away, only stay finite
        got = self._gather(torch.tensor([n], dtype=torch.long))
        return n if self.manager.errored() is not None else int(got.max())

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Key-wise sum of every participant's dict (keys may differ): pickled, gathered as bytes."""
        blob = torch.frombuffer(bytearray(pickle.dumps(values)), dtype=torch.uint8).long()
        size = self._gather(torch.tensor([blob.numel()]))
        if self.manager.errored() is not None:
            return values
        padded = torch.zeros(int(size.max()), dtype=torch.long)
        padded[: blob.numel()] = blob
        rows = self._gather(padded)
        if self.manager.errored() is not None:
            return values
        out: dict[str, float] = {}
        for r in range(rows.shape[0]):
            part = pickle.loads(bytes(rows[r, : int(size[r, 0])].to(torch.uint8).tolist()))
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over the participants (one flat all-reduce)."""
        params = [p for p in model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._sum(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()


def leader_present(dp: ElasticDP, is_leader: bool) -> bool:
    """Whether the leader (replica 0) is in this quorum: one all-reduce of a flag only the leader sets, made
    by every participant at the same point of each step. A replica whose request waited out the lighthouse's
    join timeout while the leader was generating can land in a quorum without it, and must not train there
    (it has no batch for that quorum's step). True after a failed collective (the attempt is discarded)."""
    flag = dp._sum(torch.tensor([1.0 if is_leader else 0.0]))
    return dp.manager.errored() is not None or float(flag[0]) > 0


def trainer_state(trainer) -> dict:
    """What a healing replica copies from a peer: weights, optimizer, scheduler and policy version."""
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(), "version": trainer.version}


def load_trainer_state(trainer, state: dict) -> None:
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    trainer.scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))
    trainer.version = state["version"]


@contextmanager
def replica_manager(trainer, lighthouse_addr: str, replica_id: str, timeout_s: float = 10.0,
                    min_replicas: int = 1, quorum_timeout_s: float = 60.0, init_sync: bool = True,
                    load_state: Callable[[dict], None] | None = None, host: str = LOOPBACK) -> Iterator[object]:
    """A torchft Manager for one trainer replica (a replica group of one process) that heals from a peer.
    ``timeout_s``: a dead peer's all-reduce fails after at most this. ``init_sync=False`` when every replica
    starts from the same state (no copy at step 0: only a replica that is behind heals). ``load_state``: how a
    heal loads the peer's state (default ``load_trainer_state``). ``host``: where its servers listen."""
    load = load_state or (lambda sd: load_trainer_state(trainer, sd))
    with replica_group(lambda: trainer_state(trainer), load, lighthouse_addr, replica_id, timeout_s,
                       quorum_timeout_s, min_replicas, init_sync=init_sync, host=host) as manager:
        yield manager


def disagreeing_ranks(bits_rk: torch.Tensor, keys: list[str]) -> list[dict]:
    """``bits_rk[r, k]``: replica r's fingerprint of entry k; replicas must agree bit for bit. For each entry
    where they do not: the ranks that do not hold the most common value, or every rank (``ambiguous``) when
    no value is held by more ranks than any other (e.g. two replicas that differ)."""
    out = []
    for k, key in enumerate(keys):
        col = bits_rk[:, k].tolist()
        if len(set(col)) == 1:
            continue
        (top, n), *rest = Counter(col).most_common()
        ambiguous = bool(rest) and rest[0][1] == n
        out.append({"entry": key, "ambiguous": ambiguous,
                    "ranks": list(range(len(col))) if ambiguous else [r for r, v in enumerate(col) if v != top]})
    return out


def _signed(bits: int) -> int:
    """A fingerprint (mod 2^64) as an int64 (two's complement), to travel in a long tensor."""
    bits &= MASK64
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def fingerprint_row(checksums: dict, keys: list[str]) -> torch.Tensor:
    """``[len(keys)]`` int64: each entry's fingerprint (``sdc.Checksum``'s bits), ready to be gathered from
    every replica into the ``[ranks, keys]`` table ``disagreeing_ranks`` reads."""
    return torch.tensor([_signed(checksums[k][0]) for k in keys], dtype=torch.long)


class ElasticTrainer:
    """One replica of an elastic data-parallel ``Trainer`` (built with ``dp=ElasticDP(manager)``).

    ``check_replicas`` (the multi-process half of SDC recording, ``integrity/sdc.py``): replicas apply the same
    summed gradient with the same kernels, so after every step their weights and optimizer state must be
    bit-identical. Each step compares (1) this replica's start state with the state its previous step left
    (at rest: a flip in its memory names its own rank) and (2) every replica's per-layer fingerprint of the
    updated state, gathered over the quorum (one all-reduce of a few numbers per layer): a replica whose
    state differs from the others' is named. Found incidents go to ``incidents`` and a warning; counted in
    ``elastic/replica_mismatches``. Not found this way: a corrupted activation or gradient, which the sum
    spreads to every replica alike (that needs a replay of the rank's rows)."""

    def __init__(self, trainer, manager, max_attempts: int = 10, check_replicas: bool = True):
        assert isinstance(trainer.dp, ElasticDP), "build the Trainer with dp=ElasticDP(manager)"
        self.trainer = trainer
        self.manager = manager
        self.max_attempts = max_attempts
        self.failed_attempts = 0
        self.check_replicas = check_replicas
        self.incidents: list[dict] = []
        self._left: tuple[int, dict] | None = None  # (step, fingerprints) this replica's last step left

    def _check_at_rest(self, step: int) -> None:
        if self._left is None or self._left[0] != step - 1:
            return  # first step, or healed from a peer: a new state, legitimately
        now = state_checksums(self.trainer.model, self.trainer.optimizer)
        for key in sorted(now):
            if now[key][0] != self._left[1].get(key, [None])[0]:
                self._report({"step": step, "phase": "weights", "entry": key, "ranks": [self.trainer.dp.rank],
                              "ambiguous": False, "how": "at-rest check of this replica"})
                return

    def _compare_replicas(self, step: int) -> dict:
        left = state_checksums(self.trainer.model, self.trainer.optimizer)
        keys = sorted(left)
        bits = self.trainer.dp._gather(fingerprint_row(left, keys))
        if self.manager.errored() is None:
            for found in disagreeing_ranks(bits, keys):
                self._report({"step": step, "phase": "optimizer", **found, "how": "replicas compared"})
        return left

    def _report(self, incident: dict) -> None:
        self.incidents.append(incident)
        log.warning("silent data corruption on a data-parallel replica (%s): step %d, %s of %s differs on "
                    "rank(s) %s%s", incident["how"], incident["step"], incident["phase"], incident["entry"],
                    incident["ranks"], " (two-way tie: either side)" if incident["ambiguous"] else "")

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """``Trainer.step`` on ``batch`` over the live replicas (every replica passes the same batch)."""
        return self.step_at(lambda _: batch)

    def step_at(self, batch_of: Callable[[int], TrainBatch | None]) -> dict[str, float] | None:
        """One committed step; ``batch_of(k)`` is the whole batch of quorum step k (asked after the quorum:
        a replica that has just healed jumps to the quorum's step there). ``batch_of`` returning None means
        this quorum is not one to train in (a replica without its leader, ``leader_present``): the attempt
        is left uncommitted and None returned."""
        for _ in range(self.max_attempts):
            self.manager.start_quorum()
            snap = trainer_state(self.trainer)  # after the quorum: a replica that healed keeps the healed state
            snap = {"model": {k: v.detach().clone() for k, v in snap["model"].items()},
                    "optimizer": copy.deepcopy(snap["optimizer"]), "scheduler": copy.deepcopy(snap["scheduler"]),
                    "version": snap["version"]}
            step = self.manager.current_step()
            participants = self.manager.num_participants()
            if self.check_replicas:
                self._check_at_rest(step)
            batch = batch_of(step)
            if batch is None:
                self.manager.report_error(RuntimeError(f"quorum step {step}: not a step to train in"))
                self.manager.should_commit()
                return None
            metrics = self.trainer.step(batch)
            left = self._compare_replicas(step) if self.check_replicas else None
            if self.manager.should_commit():
                self._left = (step, left) if left is not None else None
                metrics["elastic/replica_mismatches"] = float(len(self.incidents))
                metrics["elastic/participants"] = float(participants)
                metrics["elastic/failed_attempts"] = float(self.failed_attempts)
                metrics["elastic/step"] = float(step)
                return metrics
            self.failed_attempts += 1
            load_trainer_state(self.trainer, snap)  # a peer died mid-step: the same batch again, fewer replicas
            self.incidents = [i for i in self.incidents if i["step"] != step]  # found in a discarded attempt
        raise RuntimeError(f"elastic step failed {self.max_attempts} times in a row (no quorum that lasts a step)")
