"""How the vLLM engine is started (``rollout.vllm.*``) and how a checkpoint directory is read for it: shared by
the in-process engine (``vllm_engine.py``) and the server client (``vllm_server.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.config import ConfigError
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
    return_routes: bool = False
    """MoE models: ask vLLM for the experts each token was routed to (its ``enable_return_routed_experts``) and
    fill ``Trajectory.routes`` for Rollout Routing Replay (R3, ``trainer.moe.routing_replay=r3``, which needs
    it on). A vLLM without that engine argument is one error naming its version.
    In-process engine only: vLLM's OpenAI server does not return routes. Ignored for a dense model."""
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


# ---- mixture-of-experts models ------------------------------------------------------------------------------
ROUTES_ARG = "enable_return_routed_experts"
"""vLLM's engine argument that records each token's routed experts (``CompletionOutput.routed_experts``)."""


def check_routes_supported(vllm) -> None:
    """One line when the installed vLLM cannot return routed experts (no ``enable_return_routed_experts`` among
    its ``EngineArgs``), which routing replay R3 with the vLLM engine needs."""
    fields = getattr(getattr(vllm, "EngineArgs", None), "__dataclass_fields__", {})
    if ROUTES_ARG not in fields:
        raise ConfigError(f"trainer.moe.routing_replay=r3 with rollout.engine=vllm needs vLLM's {ROUTES_ARG} "
                          f"(per-token routed experts); the installed vLLM {getattr(vllm, '__version__', '?')} "
                          "does not have it: upgrade vLLM, or use rollout.engine=local or routing_replay=r2")


def routes_of(routed_experts, num_tokens: int, moe_layers: Sequence[int] | None,
              layers_k: tuple[int, int]) -> torch.Tensor:
    """``Trajectory.routes`` (uint8 [num_tokens, MoE layers, k], ``NO_ROUTE`` where unknown) from vLLM's
    ``CompletionOutput.routed_experts``: int [fed tokens, num_hidden_layers, k], one row per token the model
    read (prompt + sampled - 1: the last sampled token is never fed), every decoder layer (a dense layer's rows
    are zeros); ``moe_layers`` picks the layers with routers (None: all). None (vLLM returned nothing: an
    aborted request) gives ``layers_k``-shaped ``NO_ROUTE`` rows, which replay leaves to the trainer's choice."""
    from tidal.models.moe import NO_ROUTE, ROUTE_DTYPE

    routes = torch.full((num_tokens, *layers_k), NO_ROUTE, dtype=ROUTE_DTYPE)
    if routed_experts is None:
        return routes
    got = torch.as_tensor(routed_experts)
    assert got.dim() == 3, f"vLLM's routed_experts is [tokens, layers, k], got {tuple(got.shape)}"
    if moe_layers is not None:
        got = got[:, list(moe_layers)]
    assert tuple(got.shape[1:]) == tuple(layers_k), (
        f"vLLM's routed experts are [tokens, {tuple(got.shape[1:])}], the model's routes [tokens, {tuple(layers_k)}]")
    assert got.numel() == 0 or int(got.max()) < NO_ROUTE, f"expert id {int(got.max())} does not fit uint8 routes"
    n = min(num_tokens, len(got))
    routes[:n] = got[:n].to(ROUTE_DTYPE)
    return routes


def routes_shape(model_dir: str | Path, moe_layers: Sequence[int] | None) -> tuple[int, int] | None:
    """(MoE layers, k) of the model in ``model_dir`` (its ``config.json``): the shape of a token's routes; None for
    a dense model (no ``num_experts_per_tok``), which has none to return."""
    import json

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config = config.get("text_config", config)
    if not config.get("num_experts_per_tok"):
        return None
    layers = len(moe_layers) if moe_layers is not None else int(config["num_hidden_layers"])
    return layers, int(config["num_experts_per_tok"])


def moe_layer_indices(model: torch.nn.Module) -> list[int] | None:
    """The decoder-layer indices of ``model``'s routers (``...layers.<i>.mlp.gate``), None for a dense model: vLLM
    reports routes for every decoder layer, tidal for the MoE layers only (``models/moe.py``)."""
    from tidal.models.moe import find_routers

    routers = set(map(id, find_routers(model)))
    if not routers:
        return None
    out = []
    for name, module in model.named_modules():
        if id(module) in routers:
            parts = name.split(".")
            digits = [int(p) for p, prev in zip(parts[1:], parts) if prev == "layers" and p.isdigit()]
            assert digits, f"router {name}: no decoder-layer index in its name"
            out.append(digits[0])
    return out


def hub_layout(model_dir: str | Path) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """``hub_layout_of`` the config in ``model_dir`` (None without one)."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return None
    from transformers import AutoConfig

    return hub_layout_of(AutoConfig.from_pretrained(model_dir, local_files_only=True))


def hub_layout_of(config) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """For an architecture transformers 5 holds in another layout than its files (MoE experts fused into one
    [E, ...] tensor per projection): a function turning a trainer state dict into the Hub's per-expert names,
    which vLLM's weight loader maps (``revert_weight_conversion`` on a meta-device model of ``config``, as
    ``save_pretrained`` does). None when the layouts are the same (dense models) or ``config`` is None."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if config is None or get_checkpoint_conversion_mapping(getattr(config, "model_type", None)) is None:
        return None
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return lambda state: revert_weight_conversion(meta, dict(state))
