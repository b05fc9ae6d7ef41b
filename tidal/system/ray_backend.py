"""``system.backend=ray``: start (or join) Ray, then the rollout and reward workers, from a RunConfig.

What runs where: rollout workers (``ray_engine.py``) and reward workers (``ray_rewards.py``) are Ray
actors placed by ``system.rollout_worker_cpus/gpus`` and ``system.reward_worker_cpus``; the
controller, the trainer and the evaluation engine stay in the driver process (the one running
``tidal train``). With ``system.ray_address`` unset a local Ray instance is started for the run and
shut down at its end; otherwise the run joins that cluster (``ray start --head`` on the head node,
``ray start --address HEAD:6379`` on the others; tidal must be installed on every node).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.rewards.pool import RewardPool
from tidal.system.config import RunConfig
from tidal.system.ray_engine import RayEngine, RayEngineConfig, init_ray, require_ray
from tidal.system.ray_rewards import RayRewardPool


def ray_engine_config(cfg: RunConfig) -> RayEngineConfig:
    s = cfg.system
    return RayEngineConfig(engine=cfg.rollout.engine, num_workers=s.rollout_workers, num_cpus=s.rollout_worker_cpus,
                           num_gpus=s.rollout_worker_gpus, num_threads=s.rollout_worker_threads,
                           max_restarts=s.rollout_worker_restarts)


def start_ray_backend(cfg: RunConfig, model: torch.nn.Module, tokenizer, version: int,
                      reward_fn: Callable) -> tuple[RayEngine, RewardPool | RayRewardPool]:
    """The rollout engine and reward pool of a Ray run. ``reward.num_workers=0`` scores inline in the
    driver, as with the local backend. The engine's ``close()`` stops Ray if this call started it."""
    started = init_ray(cfg.system.ray_address)
    try:
        engine = RayEngine(model, tokenizer, cfg.rollout, cfg.seed, version, ray_engine_config(cfg))
        if cfg.reward.num_workers > 0:
            pool = RayRewardPool(reward_fn, cfg.reward, cfg.reward.num_workers, num_cpus=cfg.system.reward_worker_cpus)
        else:
            pool = RewardPool(reward_fn, cfg.reward)
    except BaseException:
        if started:
            require_ray().shutdown()
        raise
    engine.owns_ray = started
    return engine, pool
