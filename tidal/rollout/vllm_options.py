"""How the vLLM engine is started (``rollout.vllm.*``) and how a checkpoint directory is read for it: shared by
the in-process engine (``vllm_engine.py``) and the server client (``vllm_server.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class VllmOptions:
    """How the vLLM engine is started (``rollout.vllm.*``)."""

    dtype: str | None = None
    """Weights/activations dtype in vLLM. None: ``float32`` on CPU (vLLM's ``auto`` would cast a float32
    checkpoint to bfloat16, which this CPU emulates slowly) and ``auto`` on GPU (bf16/fp16)."""
    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs: a faster start; at tiny sizes also no slower to run."""
    enable_prefix_caching: bool = True
    """Share the prompt's KV blocks across a group's samples (dropped at every weight update)."""
    gpu_memory_utilization: float = 0.5
    """GPU share for weights + KV cache (the trainer is colocated); unused on CPU."""
    cpu_kv_cache_gb: float = 0.5
    """KV cache size on CPU in GiB (vLLM's ``kv_cache_memory_bytes``); the tiny model at 128 tokens x
    256 sequences needs ~0.13."""
    max_model_len: int | None = None
    """Context length; None: the model's ``max_position_embeddings``."""
    servers: list[str] | None = None
    """Base URLs of OpenAI-compatible vLLM servers (``http://host:8000``): use them instead of an
    in-process engine (``vllm_server.py``)."""
    load_balance: str = "least_loaded"
    """Server choice per request: ``least_loaded`` or ``round_robin``."""
    weights_dir: str | None = None
    """Server mode: the directory the servers load their weights from (shared filesystem); a weight
    update writes the new weights there and asks each server to reload."""


def read_checkpoint_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (``*.safetensors``), on CPU, with the head
    written out when embeddings are tied: ``save_pretrained`` stores a tied ``lm_head.weight`` only as
    the embedding, and vLLM's in-place reload from disk then leaves its head unloaded (measured: its
    log-probs were ~1 nat off), while the state-dict path, which carries ``lm_head.weight``, is exact."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
