"""Which attention rules a model has, and the one check that refuses a model tidal would compute wrongly.

Why: the local engine (``rollout/slots.py``, ``rollout/graphs.py``) and the trainer's packed layouts
(``train/packing.py``, ``train/prefix_tree.py``) build attention masks themselves and hand them to the
model's forward ready-made. transformers then builds none: a prepared 4-D mask (or ``BlockMask``) goes to
every layer as it is. So every rule that decides what a query may see must be in those masks, or the
model silently computes something other than its own forward (a sliding-window layer given a full causal
mask attends to the whole context; nothing raises). ``attention_layout`` reads the rules from the config,
the mask builders apply them, and ``check_architecture`` refuses, with one line naming the feature, any
model whose forward depends on something the masks or the slot cache do not carry.

Sliding windows (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3's local layers): a query at
position p sees the keys at positions p - W < k <= p, W keys counting itself (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). The window is over *positions*: in a
packed row or a prefix trie positions restart per sequence or follow the trie's depth, and in the slot
cache a row starts at its own column and may hold rolled-back draft columns, so columns are not positions.
Each builder therefore compares the query's and the key's position ids, never their columns.

How a model takes per-layer masks (transformers 5): a config with ``layer_types`` (Gemma 2/3, Qwen2/3,
Cohere 2, OLMo 3, ...) makes the base model's forward accept ``attention_mask`` as a dict keyed by layer
type, used as is; a config without it but with ``sliding_window`` (Mistral, Mixtral, Phi-3, Starcoder2)
applies that window to every layer from one mask. ``AttentionLayout.build`` returns what the forward takes:
one mask when all layers share a rule, else the dict.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
T = TypeVar("T")


class UnsupportedArchitecture(ValueError):
    """A model whose attention tidal's engine or trainer would compute differently from its own forward."""


@dataclass(frozen=True)
class AttentionLayout:
    """The attention rules of a model's decoder layers: for each layer type its window (None: full causal)."""

    windows: dict[str, int | None]
    """Layer type -> sliding window in positions (None: full causal attention), for the types the model has."""

    @property
    def sliding(self) -> bool:
        """Whether any layer has a window (only then do the mask builders add one)."""
        return any(w is not None for w in self.windows.values())

    def build(self, make: Callable[[int | None], T]) -> T | dict[str, T]:
        """What the model's forward takes as ``attention_mask``: ``make(window)`` once per distinct window, as
        a dict keyed by layer type when the layers differ, else the one mask (which every layer then uses)."""
        made: dict[int | None, T] = {}
        for w in self.windows.values():
            if w not in made:
                made[w] = make(w)
        if len(made) == 1:
            return next(iter(made.values()))
        return {kind: made[w] for kind, w in self.windows.items()}

    def masks(self, full_b1qk: torch.Tensor, query_pos_bq: torch.Tensor, key_pos_bk: torch.Tensor):
        """The per-layer-type masks from a full-attention bool mask [B, 1, Q, K] and the position ids of its
        queries [B, Q] and keys [B, K]: a windowed layer also needs ``query_pos - key_pos < window``.
        Without windows, ``full_b1qk`` itself (no extra work)."""
        if not self.sliding:
            return full_b1qk
        distance = query_pos_bq[:, None, :, None] - key_pos_bk[:, None, None, :]
        return self.build(lambda w: full_b1qk if w is None else full_b1qk & (distance < w))


def attention_layout(config, name: str | None = None) -> AttentionLayout:
    """The layout ``config`` declares (see the module docstring); layer types other than full and sliding
    attention raise ``UnsupportedArchitecture`` (naming the model ``name``, default the config's architecture)."""
    name = name or _name(config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    kinds = list(dict.fromkeys(types)) if types else [SLIDING if window is not None else FULL]
    other = [k for k in kinds if k not in (FULL, SLIDING)]
    if other:
        raise UnsupportedArchitecture(f"{name}: layer type {other[0]!r} is not supported (tidal runs full and "
                                      "sliding-window attention layers only)")
    if SLIDING in kinds and window is None:
        raise UnsupportedArchitecture(f"{name}: sliding_attention layers without config.sliding_window")
    return AttentionLayout({k: window if k == SLIDING else None for k in kinds})


def check_architecture(model: torch.nn.Module) -> AttentionLayout:
    """Refuse (``UnsupportedArchitecture``, one line naming the feature) a model whose forward depends on
    something tidal's masks and slot cache do not carry; return its attention layout otherwise.

    Called where the local engine and the trainer take a model. Each refused feature is a rule applied
    inside the attention or the cache that a prepared mask cannot express, or a cache tidal does not keep."""
    base = _base(model)
    config, name = getattr(base, "config", None), type(base).__name__
    if config is None:  # not a transformers model (a test's bare module, a value head): no attention to check
        return AttentionLayout({FULL: None})
    found = _unsupported(config)
    if found:  # the first one: a model with several gets them named one at a time, as each is fixed
        raise UnsupportedArchitecture(f"{name}: {found[0]} is not supported by tidal's local engine and trainer")
    if any(n.endswith("sinks") for n, _ in model.named_parameters()):
        raise UnsupportedArchitecture(f"{name}: attention sinks (learned per-head logits, GPT-OSS) are not "
                                      "supported by tidal's local engine and trainer")
    layout = attention_layout(config, name)
    if len(layout.windows) > 1 and not _takes_mask_dict(type(_decoder(base))):
        raise UnsupportedArchitecture(f"{name}: mixed layer types {sorted(layout.windows)} in a model whose forward "
                                      "takes no per-layer-type mask dict")
    return layout


def _unsupported(config) -> list[str]:
    """The features of ``config`` tidal does not compute, in words (empty when none)."""
    get = functools.partial(getattr, config)
    found = []
    if get("attn_logit_softcapping", None) is not None:
        found.append("attention logit softcapping (attn_logit_softcapping, Gemma 2)")
    if get("attention_chunk_size", None) is not None:
        found.append("chunked attention (attention_chunk_size, Llama 4)")
    if get("kv_lora_rank", None) is not None or get("q_lora_rank", None) is not None:
        found.append("multi-head latent attention (kv_lora_rank, DeepSeek-V2/V3)")
    if get("is_encoder_decoder", False) or get("cross_attention_layers", None) or get("add_cross_attention", False):
        found.append("cross attention")
    if get("use_bidirectional_attention", False) or not get("is_causal", True):
        found.append("bidirectional attention")
    if get("alibi", False) or get("position_embedding_type", None) == "alibi":
        found.append("ALiBi position biases")
    if get("num_kv_shared_layers", 0):
        found.append("KV sharing across layers (num_kv_shared_layers, Gemma 3n)")
    if any(get(k, None) for k in ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices")):
        found.append("recurrent or state-space layers")
    rope = {p.get("rope_type", p.get("type")) for p in _rope_parameters(config)}
    if rope & {"dynamic", "longrope"}:
        found.append(f"RoPE scaling that depends on the sequence length ({sorted(rope & {'dynamic', 'longrope'})[0]})")
    return found


def _rope_parameters(config) -> list[dict]:
    """The config's RoPE parameter dicts: transformers 5's ``rope_parameters`` (flat, or one per layer type)
    and the older ``rope_scaling``."""
    out = []
    for value in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            out += nested if nested else [value]
    return out


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model


@functools.cache
def _takes_mask_dict(cls: type) -> bool:
    """Whether the decoder class's forward uses an ``attention_mask`` dict as is (transformers 5 models with
    ``layer_types``: ``if not isinstance(causal_mask_mapping := attention_mask, dict): ...``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


def _name(config) -> str:
    archs = getattr(config, "architectures", None)
    return archs[0] if archs else getattr(config, "model_type", None) or type(config).__name__
