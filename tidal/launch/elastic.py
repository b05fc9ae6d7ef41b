"""A run with ``trainer.data_parallel=elastic``: ``tidal train`` in one process that leads its own replicas.

    tidal train quickstart --set trainer.data_parallel=elastic --set trainer.elastic.replicas=2 --out runs/el

No torchrun: the run's process is the whole run as one process runs it (``run.prepare``: controller,
rollout engines, rewards, trackers, checkpoints, report), except that its trainer becomes the elastic
leader (``parallel/elastic_leader.py``), which starts ``trainer.elastic.replicas - 1`` replica processes,
restarts one that dies and keeps training on the live ones meanwhile (docs/faults.md). The SDC guard's
recording and replay are 1-process (``integrity/guard.py``); here the replicas compare their states every step
instead (``trainer.elastic.check_replicas``), so ``sdc.*`` settings are refused (``validate.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from tidal.config import ConfigError
from tidal.parallel.elastic_leader import elastic_leader
from tidal.parallel.elastic_replica import ReplicaSpec
from tidal.parallel.replica_group import quiet_torchft
from tidal.system import run as run_lib
from tidal.system.config import RunConfig
from tidal.system.controller import RunResult
from tidal.train.checkpoint import latest_checkpoint


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, task=None) -> RunResult:
    """``run.train`` with an elastic data-parallel trainer (see the module docstring). ``task``: as for
    ``run.prepare``."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("trainer.data_parallel=elastic starts and restarts its own replica processes: run "
                          "`tidal train` without torchrun (trainer.elastic.replicas sets how many)")
    quiet_torchft()
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("trainer.data_parallel=elastic needs torchft: pip install -e '.[diloco]'") from None
    out_dir = Path(out_dir)
    controller = run_lib.prepare(cfg, out_dir, resume, task=task)
    try:
        if controller.sdc is not None:  # 1-process recording and replay (integrity/guard.py); replicas check each other
            controller.sdc.close()
            controller.sdc = None
        single = controller.trainer
        ckpt = latest_checkpoint(out_dir / "checkpoints") if resume else None
        spec = ReplicaSpec(base=str(run_lib.base_model_path(cfg, controller.task, progress=False)),
                           checkpoint=str(ckpt) if ckpt is not None else None, algo=cfg.algo,
                           optim=single.optim_cfg,  # decay_steps resolved for the run (optim.for_run)
                           trainer=cfg.trainer, seed=cfg.seed, num_threads=cfg.system.num_threads, lighthouse="")
        with elastic_leader(single, spec) as leader:
            controller.trainer = leader
            return controller.run()
    finally:
        run_lib.close(controller)
        if cfg.log.report:
            run_lib.write_pages(out_dir)
