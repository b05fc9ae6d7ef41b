"""A run with an FSDP data-parallel trainer over N processes, launched by torchrun:

    torchrun --nproc_per_node 2 -m tidal.cli train quickstart --set system.num_threads=1 --out runs/dp

Rank 0 is the run exactly as one process runs it (``run.prepare``: controller, rollout engines, rewards,
trackers, checkpoints, report), except that its trainer is sharded with the other ranks and wrapped in a
``LeaderTrainer``. The other ranks build the same trainer and ``follow``: each training step, weight
gather and checkpoint gather on rank 0 is announced to them (the TrainBatch travels with the
announcement) and they run it too. Only rank 0 generates, scores, evaluates and writes files.

Every rank starts from rank 0's weights (broadcast after sharding) or, with ``--resume``, from the
checkpoint rank 0 reads; checkpoints have the 1-process layout, so a run may resume with a different
number of processes. torch threads: rank 0 follows ``system.num_threads`` / ``system.async_threads``
as in one process, the other ranks use ``system.num_threads``; keep the total within the cores.

With ``trainer.data_parallel=diloco`` the ranks are DiLoCo workers instead (``parallel/diloco_trainer.py``):
no sharding, each rank trains a full replica on its own groups and the replicas meet every
``trainer.diloco.sync_every`` optimizer steps through torchft; rank 0 hosts the torchft lighthouse::

    torchrun --nproc_per_node 2 -m tidal.cli train quickstart --set trainer.data_parallel=diloco \
        --set trainer.diloco.sync_every=10 --set system.num_threads=1 --out runs/dp-diloco

Both modes are all or nothing: rank 0 hands each TrainBatch to the others with a broadcast on the default
process group, which a dead rank breaks, and torchrun restarts the whole job. ``trainer.data_parallel=elastic``
is the mode that survives a dead rank; it is launched without torchrun (refused here) and lives in
``launch/elastic.py``: the run's process starts, feeds and restarts its replica processes itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.config import ConfigError
from tidal.models import lora, tiny
from tidal.parallel import fsdp as distributed
from tidal.parallel.diloco import start_lighthouse
from tidal.parallel.diloco_trainer import DiLoCoTrainer, broadcast_weights
from tidal.parallel.fsdp import LOCAL, DataParallel, LeaderTrainer, follow
from tidal.system import run as run_lib
from tidal.system.config import RunConfig
from tidal.system.controller import RunResult
from tidal.train.checkpoint import latest_checkpoint
from tidal.train.trainer import Trainer
from tidal.utils.device import resolve_device
from tidal.utils.seeding import seed_everything


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, task=None) -> RunResult | None:
    """``run.train`` on every rank of a torchrun launch. Rank 0 returns the run's result, the others None.
    ``task``: rank 0's, as for ``run.prepare``."""
    if cfg.trainer.data_parallel == "elastic":  # before the process group: every rank says it, none waits
        raise ConfigError("trainer.data_parallel=elastic starts and restarts its own replica processes: run "
                          "`tidal train` without torchrun (trainer.elastic.replicas sets how many)")
    if resolve_device(cfg.system.device).type != "cpu":  # before the process group: every rank says it, none waits
        raise ConfigError(f"system.device={cfg.system.device} under torchrun: data-parallel trainers (FSDP2, DiLoCo) "
                          "run on the CPU (gloo) for now; use system.device=cpu, or one process on the GPU")
    dp = distributed.init_distributed()
    try:
        cfg = dp.broadcast(cfg)  # one config for every rank: rank 0's
        if dp.rank == 0:
            return _lead(cfg, Path(out_dir), resume, dp, task)
        _follow(cfg, dp)
        return None
    finally:
        distributed.teardown()


def _trainer(cfg: RunConfig, model: torch.nn.Module, ref_model: torch.nn.Module | None, dp: DataParallel,
             ckpt: str | None, lighthouse: str | None) -> Trainer | DiLoCoTrainer:
    """The sharded trainer (or, with a lighthouse, the DiLoCo worker), built alike on every rank, starting
    from the checkpoint or rank 0's weights."""
    if lighthouse is not None:
        trainer = Trainer(model, cfg.algo, cfg.optim, cfg.trainer, ref_model=ref_model, dp=LOCAL,
                          max_steps=cfg.max_steps)
        if ckpt is not None:  # every rank reads rank 0's files: same weights, inner optimizer, schedule
            trainer.load_checkpoint(ckpt)
        else:
            broadcast_weights(model)
        return DiLoCoTrainer(trainer, cfg.trainer.diloco, dp, lighthouse)
    start = model.state_dict() if dp.rank == 0 and ckpt is None else {}
    trainer = Trainer(model, cfg.algo, cfg.optim, cfg.trainer, ref_model=ref_model, dp=dp, max_steps=cfg.max_steps)
    if ckpt is not None:
        trainer.load_checkpoint(ckpt)
    else:
        distributed.load_full_state(distributed.root_of(model), None, start, None)
    return trainer


def _lead(cfg: RunConfig, out_dir: Path, resume: bool, dp: DataParallel, task) -> RunResult:
    try:
        controller = run_lib.prepare(cfg, out_dir, resume, task=task)
        if controller.sdc is not None:  # SDC recording and replay are 1-process only (integrity/guard.py)
            controller.sdc.close()
            controller.sdc = None
        base = run_lib.base_model_path(cfg, controller.task, progress=False)  # cached by prepare
        ckpt = latest_checkpoint(out_dir / "checkpoints") if resume else None
        # every rank's quorum: a torchrun job is all or nothing, and the first round should have them all
        lighthouse = start_lighthouse(min_replicas=dp.world_size) if cfg.trainer.data_parallel == "diloco" else None
    except BaseException:
        dp.broadcast(None)  # let the other ranks exit instead of waiting out the timeout
        raise
    addr = lighthouse.address() if lighthouse is not None else None
    dp.broadcast((str(base), str(ckpt) if ckpt is not None else None, addr))
    single = controller.trainer  # its engines were copied from this model: now shard it in place
    trainer = _trainer(cfg, single.model, single.ref_model, dp, str(ckpt) if ckpt else None, addr)
    leader = LeaderTrainer(trainer)
    controller.trainer = leader
    try:
        return controller.run()
    finally:
        leader.close()
        if lighthouse is not None:
            trainer.close()
            lighthouse.shutdown()
        run_lib.close(controller)
        if cfg.log.report:
            run_lib.write_pages(out_dir)


def _follow(cfg: RunConfig, dp: DataParallel) -> None:
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.system.num_threads)
    paths = dp.broadcast(None)
    if paths is None:  # rank 0 failed before training; it reports why
        return
    base, ckpt, lighthouse = paths
    model, _ = tiny.load(base)
    ref_model = tiny.load(base)[0] if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled else None
    if cfg.model.lora.enabled:  # as rank 0's prepare: adapters on the frozen base (rank 0's values broadcast next)
        model = lora.policy(model, cfg.model.lora, base, cfg.system.device)
    trainer = _trainer(cfg, model, ref_model, dp, ckpt, lighthouse)
    try:
        follow(trainer)
    finally:
        if lighthouse is not None:
            trainer.close()
