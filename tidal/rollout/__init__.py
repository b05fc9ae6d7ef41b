"""Rollout engines: generate trajectories with behaviour log-probs and policy versions."""

from tidal.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("local")
def _local_engine(model, tokenizer, cfg, seed: int, version: int):
    from tidal.rollout.local import LocalEngine

    return LocalEngine(model, tokenizer, cfg, seed=seed, version=version)
