"""How the vLLM engine is started (``rollout.vllm.*``) and how a checkpoint directory is read for it: shared by
the in-process engine (``vllm_engine.py``) and the server client (``vllm_server.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.models.tied import retie


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
    speculative_config: dict | None = None
    """vLLM's ``speculative_config``, passed as is (e.g. ``{"method": "eagle3", "model": ...}``); None: built
    from ``rollout.speculative`` (``speculative_config``). In-process engine only (servers take theirs on
    their own command line)."""


def speculative_config(spec, opts: VllmOptions) -> dict | None:
    """The ``speculative_config`` vLLM starts with: ``rollout.vllm.speculative_config`` if given, else
    ``rollout.speculative`` mapped to vLLM's names (``ngram``: prompt_lookup_max/min as ngram_max/min;
    ``draft_model``: the draft's directory; ``mtp``: the model's own MTP layers), None when off. vLLM
    verifies drafts by rejection sampling (Leviathan et al. 2023): its samples follow the policy's
    distribution but are not the tokens its plain decoding would draw, unlike the local engine's."""
    if opts.speculative_config is not None:
        return dict(opts.speculative_config)
    if spec is None or not spec.enabled:
        return None
    out: dict = {"method": spec.method, "num_speculative_tokens": spec.num_draft_tokens}
    if spec.method == "ngram":
        out |= {"prompt_lookup_max": spec.ngram_max, "prompt_lookup_min": spec.ngram_min}
    elif spec.method == "draft_model":
        out["model"] = spec.draft_model
    return out


SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_counts(metrics) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) from vLLM's ``LLM.get_metrics()`` counters, summed over engines; None
    when it reports none (speculation off)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    seen = False
    for m in metrics:
        if m.name in totals:
            totals[m.name] += float(m.value)
            seen = True
    return (totals[SPEC_COUNTERS[0]], totals[SPEC_COUNTERS[1]]) if seen else None


TIED_HEAD = {"lm_head.weight": "model.embed_tokens.weight"}
"""A Hugging Face causal LM's tied head (``tie_word_embeddings``), as ``models/tied.py`` names aliases."""


def tied_head_names(model_dir: str | Path) -> dict[str, str]:
    """``TIED_HEAD`` when ``model_dir/config.json`` ties the embeddings, else ``{}``. A trainer's weight sync
    sends a tied head once, as the embedding (``models/tied.py``); vLLM is given it under both names, as a
    checkpoint directory's is (``read_checkpoint_dir`` says why)."""
    import json

    config = Path(model_dir) / "config.json"
    tied = config.exists() and json.loads(config.read_text()).get("tie_word_embeddings", False)
    return dict(TIED_HEAD) if tied else {}


def read_checkpoint_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (``*.safetensors``), on CPU, with the head
    written out when embeddings are tied: ``save_pretrained`` stores a tied ``lm_head.weight`` only as
    the embedding, and vLLM's in-place reload from disk then leaves its head unloaded (measured: its
    log-probs were ~1 nat off), while the state-dict path, which carries ``lm_head.weight``, is exact."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return retie(state, tied_head_names(path))
