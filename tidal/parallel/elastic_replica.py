"""One replica process of ``trainer.data_parallel=elastic``: a full ``Trainer`` that trains the batches its
leader sends, as one torchft replica (``elastic_dp.ElasticTrainer``).

The leader (``elastic_leader.py``) starts this process with one end of a pipe. A reader thread drains the
pipe into a local queue at once, so the leader's send of a large batch never waits on this process being
inside a step or a quorum. Each command is ``(k, version, pickled TrainBatch)``: the batch of the leader's
quorum step k, sent before the leader asks for that quorum. The replica then asks for a quorum too; inside
it, a replica that is behind heals (torchft loads the live peer's weights, optimizer, scheduler and
version) and jumps to the quorum's step q. ``batch_of(q)`` takes the command for q from the queue (a
replica that missed a quorum finds a later command there: the leader sends each command before it joins
that quorum) and checks with one all-reduce that the leader is in the quorum (``leader_present``): a
replica left waiting past the lighthouse's join timeout while the leader generated can land in a quorum
of replicas alone, which must not train. After each committed step the replica reports its step and
how many times it has healed (``("done", step, heals)``); the leader turns that into ``elastic/heals``.

The process ends on ``stop`` or when the pipe closes (the leader is gone); the leader restarts it if it
ends any other way. Why a spawned process, not a fork: the leader runs threads (generation, scorer, torchft)
that a fork would copy mid-state.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass

import torch

from tidal.algo.config import AlgoConfig
from tidal.models import tiny
from tidal.optim import OptimConfig
from tidal.parallel.elastic_dp import ElasticDP, ElasticTrainer, leader_present, load_trainer_state, replica_manager
from tidal.parallel.fsdp import DEFAULT_TIMEOUT_S
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.utils.seeding import seed_everything

HEARTBEAT_INTERVAL_S = 0.1
"""torchft's default: a Manager heartbeats to the lighthouse this often."""
FAULT_EXIT_CODE = 17
"""Exit status of a replica killed by ``trainer.elastic.fault_step`` (fault injection)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process needs to build its trainer as the leader built its own (pickled to the
    spawned process)."""

    base: str
    """The run's base model directory (``tiny.load``): the weights a replica starts from before it heals."""
    checkpoint: str | None
    """With ``--resume``: the checkpoint the leader resumed from (weights, optimizer, scheduler, version)."""
    algo: AlgoConfig
    optim: OptimConfig
    trainer: TrainerConfig
    seed: int
    num_threads: int
    """torch threads of this process (``system.num_threads``)."""
    lighthouse: str
    """The torchft lighthouse the leader hosts."""


_STOP = ("stop",)
"""The leader's last message (compared by value: it arrives unpickled)."""


def _read(conn, inbox: queue.Queue) -> None:
    """Move every message from the leader into ``inbox`` as soon as it arrives; a closed pipe is a stop."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(_STOP)


class _Stopped(Exception):
    """The leader said stop (or went away) while this replica waited for a step's batch."""


def replica_main(conn, spec: ReplicaSpec, index: int, generation: int, fault_step: int | None) -> None:
    """The body of replica ``index``'s ``generation``-th process (0: first start)."""
    torch.set_num_threads(spec.num_threads)
    seed_everything(spec.seed)
    model, _ = tiny.load(spec.base)
    ref_model = tiny.load(spec.base)[0] if spec.algo.kl_coef > 0 else None
    dp = ElasticDP(None)  # the manager needs the trainer (to heal it) and the trainer needs the dp
    trainer = Trainer(model, spec.algo, spec.optim, spec.trainer, ref_model=ref_model, dp=dp)
    if spec.checkpoint is not None:
        trainer.load_checkpoint(spec.checkpoint)
    heals = [0]

    def heal(state: dict) -> None:
        heals[0] += 1
        load_trainer_state(trainer, state)

    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(conn, inbox), name="leader-pipe", daemon=True).start()
    armed = [False]
    if fault_step is not None and index == 1 and generation == 0:
        def die(module, args, output):
            if armed[0]:
                os._exit(FAULT_EXIT_CODE)
        model.get_decoder().register_forward_hook(die)  # the trainer calls the decoder, then the head

    cfg = spec.trainer.elastic
    # init_sync=False: every replica starts from the leader's base or checkpoint; only one that is behind heals
    with replica_manager(trainer, spec.lighthouse, f"replica{index}", cfg.timeout_s, quorum_timeout_s=DEFAULT_TIMEOUT_S,
                         init_sync=False, load_state=heal, host=cfg.host) as manager:
        dp.manager = manager
        elastic = ElasticTrainer(trainer, manager, check_replicas=cfg.check_replicas)
        time.sleep(5 * HEARTBEAT_INTERVAL_S)  # a quorum waits only for replicas the lighthouse has heard from
        conn.send(("ready", index, generation))
        command = [inbox.get()]
        used = [-1]  # the quorum step of the last command this replica trained on

        def batch_of(q: int):
            with_leader = leader_present(dp, is_leader=False)  # every participant makes this all-reduce first
            while not _is_stop(command[0]) and command[0][0] < q:
                command[0] = inbox.get()  # a command for a quorum this replica missed: already sent, skip it
            if _is_stop(command[0]):
                raise _Stopped
            k, version, blob = command[0]
            if not with_leader or k != q:
                return None  # not the leader's quorum: keep the command for the quorum it was sent for
            trainer.version = version  # the leader's count, skipped steps included
            armed[0] = fault_step is not None and version + 1 >= fault_step  # a skipped step: the next that trains
            used[0] = k
            return pickle.loads(blob)

        try:
            while not _is_stop(command[0]):
                metrics = elastic.step_at(batch_of)
                if metrics is not None:
                    conn.send(("done", int(metrics["elastic/step"]), heals[0]))
                if command[0][0] == used[0]:  # trained on: wait for the next one
                    command[0] = inbox.get()
        except _Stopped:
            pass


def _is_stop(message: tuple) -> bool:
    return message[0] == "stop"
