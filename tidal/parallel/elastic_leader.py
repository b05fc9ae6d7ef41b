"""Rank 0 of ``trainer.data_parallel=elastic``: the controller's trainer, and the replica processes it keeps alive.

Why the leader starts its replicas itself rather than torchrun: torchrun restarts the whole job when one
rank dies, and its ranks hand batches over the default process group, which a dead rank breaks. Here the
leader spawns ``elastic.replicas - 1`` processes (``elastic_replica.replica_main``), each joined to it by
its own pipe and to every other replica by torchft (``elastic_dp.ElasticDP``: a process group rebuilt
each quorum). The leader is replica 0: it trains its share of every step in its own ``ElasticTrainer``.

One step (``ElasticLeader.step``, called by the controller as ``Trainer.step``):

1. *Tend the replicas.* Read their reports; a replica whose process has ended is started again (a new
   process, up to ``elastic.max_restarts`` over the launch); wait up to ``elastic.wait_ready_s`` for
   processes that are still starting.
2. *Hand off the batch.* Send ``(k, version, pickled batch)`` to every ready replica, k being the leader's
   quorum step. A dead replica breaks only its own pipe (the send fails, the leader goes on); replicas drain
   their pipe in a thread, so a send never waits on a replica that is busy in a quorum.
3. *Train.* ``ElasticTrainer.step_at``: the quorum (a restarted replica heals from a live peer there), the
   leader-presence all-reduce, ``Trainer.step`` over the live replicas. If a replica dies mid-step, the
   survivors' all-reduce fails, they restore the step's start state and run the same batch on the smaller
   quorum: the update is exact on any number of replicas (``elastic_dp.py``).

Everything else the controller asks of its trainer (weights for the engines, checkpoints, the version) is
the leader's own full replica: checkpoints have the 1-process layout and ``--resume`` reads them with any
number of replicas. The leader is the single point of failure: if it dies the run stops (its replicas see
the pipe close and exit) and ``--resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from tidal.parallel.diloco import start_lighthouse
from tidal.parallel.elastic_dp import (
    HEARTBEAT_TIMEOUT_MS,
    ElasticConfig,
    ElasticDP,
    ElasticTrainer,
    leader_present,
    replica_manager,
)
from tidal.parallel.elastic_replica import ReplicaSpec, replica_main
from tidal.train.trainer import Trainer

log = logging.getLogger(__name__)

Start = Callable[[int, int], tuple]
"""``start(index, generation) -> (process, connection)``: a running replica process and the leader's end of
its pipe (``spawn_replica``; tests may start something lighter)."""


@dataclass
class Slot:
    """Replica ``index`` as the leader sees it: its current process and what it has reported."""

    index: int
    generation: int
    process: object
    conn: object
    ready: bool = False
    heals: dict[int, int] = field(default_factory=dict)
    """Heals reported by each of this replica's processes (generation -> count)."""
    given_up: bool = False


def spawn_replica(spec: ReplicaSpec, fault_step: int | None) -> Start:
    """A ``Start`` that spawns ``replica_main`` (a fresh interpreter: the leader's threads are not copied)."""
    ctx = multiprocessing.get_context("spawn")

    def start(index: int, generation: int):
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=replica_main, args=(theirs, spec, index, generation, fault_step),
                              name=f"tidal-replica{index}", daemon=True)
        process.start()
        theirs.close()
        return process, mine

    return start


class ElasticLeader:
    """Rank 0's trainer: ``step`` as in the module docstring; every other attribute is the leader's own
    ``Trainer``'s (weights for the engines, checkpoints, version)."""

    def __init__(self, trainer: Trainer, manager, cfg: ElasticConfig, start: Start):
        self.trainer = trainer
        self.manager = manager
        self.cfg = cfg
        self.elastic = ElasticTrainer(trainer, manager, check_replicas=cfg.check_replicas)
        self._start = start
        self.restarts = 0
        self.slots = [Slot(i, 0, *start(i, 0)) for i in range(1, cfg.replicas)]

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    # ---- the replicas ----------------------------------------------------------------------------
    def _read(self, slot: Slot) -> None:
        """Take in every report waiting on ``slot``'s pipe (ready, done)."""
        try:
            while slot.conn.poll():
                message = slot.conn.recv()
                if message[0] == "ready" and message[2] == slot.generation:
                    slot.ready = True
                elif message[0] == "done":
                    slot.heals[slot.generation] = message[2]
        except (EOFError, OSError):
            pass  # the process ended; _restart_dead sees it

    def _restart_dead(self) -> None:
        for slot in self.slots:
            if slot.given_up or slot.process.is_alive():
                continue
            self._read(slot)  # a last report may be waiting
            code = slot.process.exitcode
            slot.conn.close()
            if self.restarts >= self.cfg.max_restarts:
                slot.given_up, slot.ready = True, False
                log.warning("elastic replica %d exited (status %s); trainer.elastic.max_restarts=%d reached: "
                            "training goes on without it", slot.index, code, self.cfg.max_restarts)
                continue
            self.restarts += 1
            log.warning("elastic replica %d exited (status %s): starting it again (restart %d)", slot.index, code,
                        self.restarts)
            slot.generation += 1
            slot.ready = False
            slot.process, slot.conn = self._start(slot.index, slot.generation)

    def tend(self) -> None:
        """Read reports, restart replicas whose process ended, and wait up to ``wait_ready_s`` for starting
        ones to be ready."""
        deadline = time.monotonic() + self.cfg.wait_ready_s
        while True:
            for slot in self.slots:
                if not slot.given_up:
                    self._read(slot)
            self._restart_dead()
            starting = [s for s in self.slots if not s.given_up and not s.ready]
            left = deadline - time.monotonic()
            if not starting or left <= 0:
                return
            wait([x for s in starting for x in (s.conn, s.process.sentinel)], timeout=min(left, 1.0))

    def metrics(self) -> dict[str, float]:
        return {"elastic/replicas_alive": 1.0 + sum(not s.given_up and s.process.is_alive() for s in self.slots),
                "elastic/restarts": float(self.restarts),
                "elastic/heals": float(sum(sum(s.heals.values()) for s in self.slots))}

    # ---- the trainer -----------------------------------------------------------------------------
    def step(self, batch) -> dict[str, float]:
        self.tend()
        k = self.manager.current_step()
        command = (k, self.trainer.version, pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        for slot in self.slots:
            if slot.ready and not slot.given_up:
                try:
                    slot.conn.send(command)
                except (BrokenPipeError, EOFError, OSError):
                    slot.ready = False  # dead: the next tend restarts it

        def batch_of(q: int):
            leader_present(self.trainer.dp, is_leader=True)  # paired with each replica's check
            if q != k:
                log.warning("elastic leader: quorum step %d, expected %d (healed from a replica?)", q, k)
            return batch

        metrics = self.elastic.step_at(batch_of)
        assert metrics is not None, "the leader is in every quorum it asks for"
        metrics.update(self.metrics())
        return metrics

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the replicas (they leave their loop and exit); end any that do not within ``timeout_s``."""
        for slot in self.slots:
            if slot.given_up:
                continue
            try:
                slot.conn.send(("stop",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning("elastic replica %d did not stop within %.0f s: terminating it", slot.index, timeout_s)
                slot.process.terminate()
                slot.process.join(5.0)
            slot.conn.close()


@contextmanager
def elastic_leader(single: Trainer, spec: ReplicaSpec, start: Start | None = None) -> Iterator[ElasticLeader]:
    """Turn the run's 1-process ``single`` trainer into the elastic leader: host the lighthouse, build the
    leader's replica trainer over the same model (optimizer, scheduler and version carried over, so a
    resumed run continues exactly), join the quorum as ``replica0`` and start the other replicas.
    ``spec.lighthouse`` is filled in here."""
    cfg = single.cfg.elastic
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=int(cfg.join_timeout_s * 1000),
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, host=cfg.host)
    try:
        dp = ElasticDP(None)
        trainer = Trainer(single.model, single.algo, single.optim_cfg, single.cfg, ref_model=single.ref_model, dp=dp)
        trainer.optimizer.load_state_dict(single.optimizer.state_dict())
        trainer.scheduler.load_state_dict(single.scheduler.state_dict())
        trainer.version = single.version
        with replica_manager(trainer, lighthouse.address(), "replica0", timeout_s=cfg.timeout_s,
                             quorum_timeout_s=cfg.join_timeout_s + 60.0, init_sync=False, host=cfg.host) as manager:
            dp.manager = manager
            spec = dataclasses.replace(spec, lighthouse=lighthouse.address())
            leader = ElasticLeader(trainer, manager, cfg, start or spawn_replica(spec, cfg.fault_step))
            try:
                yield leader
            finally:
                leader.close()
    finally:
        lighthouse.shutdown()
