"""The engine's attention over grouped KV heads without ``repeat_kv`` (``rollout.decode_attention``).

Why: the local engine hands every forward a ready boolean 4-D mask (``slots.py``), and transformers' SDPA
integration (``integrations/sdpa_attention.py``, ``use_gqa_in_sdpa``) takes GQA natively on CUDA only without a
mask: with one it calls ``repeat_kv`` and copies each layer's keys and values out to all query heads, every layer,
every step. For Qwen2.5-0.5B (14 query heads over 2 KV heads) that is 7x the cache written and read again on top
of the one read attention needs. transformers 5.24 (this project's CPU venv) folds a single query token's heads
itself (``pack_gqa``, plain decode only); 5.17, the lent GPU machines', does not, and neither folds a speculative
verify step (several query tokens per row) or a padded prefill.

Two ways to attend each query head to its group's KV head in place, one SDPA call per layer, no host sync:

- ``gqa``: ``scaled_dot_product_attention(..., enable_gqa=True)`` (torch >= 2.5; "attention with grouped query
  heads", docs of ``torch.nn.functional.scaled_dot_product_attention``). One call equals SDPA over repeated K and V
  to the bit on the CPU (both run the CPU flash kernel, which takes a mask and GQA). On CUDA the kernel depends on
  the torch release (PyTorch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): flash rejects any mask;
  the memory-efficient kernel rejected unequal head counts through at least torch 2.9
  (``can_use_mem_efficient_attention``: ``check_batch_size_and_num_heads_dense<false>``; newer sources set
  ``supports_gqa = true`` there); cuDNN (preferred on sm90 in recent releases) may take it; otherwise SDPA runs its
  math kernel, which repeats K and V itself and materializes the scores, slower than ``repeat``. Measure it.
- ``fold``: the n_rep query heads of a group become n_rep query *rows* of one head, [B, H, q, D] -> [B, H_kv,
  n_rep x q, D], so SDPA sees plain multi-head shapes that every fused kernel takes with a mask (the trick of
  transformers' ``pack_gqa``, extended to q > 1). A single query token folds as a view and the mask [B, 1, 1, S]
  broadcasts over the rows as it is; q > 1 copies the query and the mask n_rep times (bool, n_rep x q x S per
  row), which is cheaper than the K/V copy it replaces while n_rep x q <= 2 x H x D x itemsize; a wider forward (a
  long prefill) goes to transformers' SDPA unchanged (``repeat_kv`` once, against quadratic attention work).

Other per-call costs, the same for every arm: SDPA turns a boolean mask into an additive one in the query's dtype
(``convert_boolean_attn_mask``) per layer, and CUDA's memory-efficient kernel pads the mask's last dimension to a
multiple of 16 when it is not. The slot cache hands attention a strided view of its buffers ([rows, heads, span,
head_dim] out of [slots, heads, columns, head_dim]); SDPA's fused kernels need only the last dimension contiguous,
so no copy is made for it here. Which kernel each arm gets on a GPU is for ``tidal bench gpu`` to report
(``decode_kernels``: ``torch._fused_sdp_choice`` on the engine's decode shapes).

Masks that are not tensors (None: transformers' causal path, which already takes GQA natively) and models without
grouped heads go to transformers' SDPA unchanged, so switching only changes the masked GQA calls.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tidal.models.architecture import UnsupportedArchitecture
from tidal.models.attention import NAME as PACKED_ATTENTION

log = logging.getLogger(__name__)

DECODE_ATTENTION = ("repeat", "gqa", "fold")
"""``rollout.decode_attention``: ``repeat`` is transformers' SDPA (``repeat_kv`` with a mask), the default."""
NAMES = {"gqa": "tidal_gqa", "fold": "tidal_gqa_fold"}
"""The attention implementations registered with transformers, by mode."""


def gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention signature (query [B, H, q, D], key/value [B, H_kv, S, D]; returns ([B, q, H, D],
    None)): a masked GQA call as one SDPA call with ``enable_gqa=True``."""
    if not _grouped(module, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def fold_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The same signature: a masked GQA call with each group's query heads folded into query rows (module
    docstring). Head h = g x n_rep + r reads KV head g, as ``repeat_kv`` lays them out."""
    b, h, q, d = query.shape
    if not _grouped(module, attention_mask, kwargs) or attention_mask.shape[1] != 1 or not _fold_pays(query, key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    n_rep = h // kv_heads
    mask = attention_mask
    if q > 1:  # row r x q + i of the fold is head r's query i: it takes query i's mask row
        rows, s = mask.shape[0], mask.shape[-1]
        mask = mask[:, :, None].expand(rows, 1, n_rep, q, s).reshape(rows, 1, n_rep * q, s)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, kv_heads, n_rep * q, d), key, value,
                                                           attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def _grouped(module: torch.nn.Module, attention_mask, kwargs: dict) -> bool:
    """Whether a call is one this module handles: grouped heads under a tensor mask, and nothing transformers'
    SDPA treats specially (a position bias, softcapping: it adds or refuses them)."""
    return (getattr(module, "num_key_value_groups", 1) > 1 and isinstance(attention_mask, torch.Tensor)
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)


def _fold_pays(query: torch.Tensor, key: torch.Tensor) -> bool:
    """A fold with q > 1 copies the bool mask n_rep times (n_rep x q bytes per key column and row) to save the K/V
    copy (2 x H x D x itemsize bytes per key column and row): fold while that is the smaller copy."""
    h, q, d = query.shape[1:]
    return q == 1 or (h // key.shape[1]) * q <= 2 * h * d * key.element_size()


def supports_enable_gqa() -> bool:
    """torch >= 2.5 takes ``enable_gqa`` in ``scaled_dot_product_attention`` (its docs, "enable_gqa")."""
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def use_engine_attention(model: torch.nn.Module, mode: str) -> str:
    """The local engine's copy: SDPA, then the ``rollout.decode_attention`` mode on top (it replaces only the
    masked grouped-head calls); returns the mode in use."""
    use_sdpa(model)
    return use_decode_attention(model, mode)


def use_sdpa(model: torch.nn.Module) -> None:
    """Run the engine's private copy on SDPA: its decode masks are ready-made booleans, which SDPA (and tidal's
    packed attention, which hands tensors to SDPA) takes as they are, while eager attention would add them to
    the scores as 0/1 and flash attention would drop them."""
    impl = model.config._attn_implementation
    if impl in ("sdpa", PACKED_ATTENTION):
        return
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError) as e:
        reason = str(e).splitlines()[0]
        raise UnsupportedArchitecture(f"the local engine needs SDPA attention and {type(model).__name__} "
                                      f"(attn_implementation={impl!r}) cannot switch to it: {reason}") from e


def use_decode_attention(model: torch.nn.Module, mode: str) -> str:
    """Switch the engine's private copy (already on SDPA, or ``tidal_packed``, which hands tensor masks to SDPA) to
    ``mode``'s attention; returns the mode in effect. ``repeat`` changes nothing. Without ``enable_gqa`` (torch <
    2.5) ``gqa`` falls back to ``repeat``, said once; ``fold`` needs no torch feature."""
    if mode not in DECODE_ATTENTION:
        raise ValueError(f"rollout.decode_attention={mode!r}: one of {', '.join(DECODE_ATTENTION)}")
    if mode == "gqa" and not supports_enable_gqa():
        log.warning("rollout.decode_attention=gqa needs torch >= 2.5 (enable_gqa); torch %s: decoding with "
                    "repeat_kv", torch.__version__)
        return "repeat"
    if mode != "repeat":
        register()
        model.set_attn_implementation(NAMES[mode])
    return mode


@functools.cache
def register() -> None:
    """Register the implementations with transformers, once per process, lazily (as ``models/attention.py``
    registers ``tidal_packed``: the registries' import costs seconds every ``tidal`` command would pay). Their
    masks are SDPA's: a 2-D padding mask (the engine's prefill) still becomes SDPA's boolean 4-D mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for mode, forward in (("gqa", gqa_attention_forward), ("fold", fold_attention_forward)):
        AttentionInterface.register(NAMES[mode], forward)
        AttentionMaskInterface.register(NAMES[mode], sdpa_mask)
