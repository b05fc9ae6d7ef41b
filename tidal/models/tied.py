"""Tied weights in state dicts: one parameter under two names, sent once and spelled out again on arrival.

A model with tied input and output embeddings (SmolLM2, Qwen2-0.5B, Gemma; ``tie_word_embeddings``) holds
one tensor that ``state_dict()`` lists twice, as ``model.embed_tokens.weight`` and ``lm_head.weight``. A
weight sync that copies entry by entry turns it into two copies and ships both: for SmolLM2-135M
(49,152 x 576 fp32 = 113 MB) 651 MB instead of 538 MB. The sender keeps the first name of each
parameter (``untie``: the embedding, as ``save_pretrained`` does) and a receiver fills the others in
from it (``retie``) or loads it where tied parameters may be left out (``load_weights``), so its copy
stays tied: loading the embedding loads the head.

Which names are aliases is read from the model itself (``named_parameters(remove_duplicate=False)``
lists a shared parameter under every name, in module order), so it holds for any architecture and
for an FSDP2-sharded model, whose tied parameters stay one ``DTensor``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter listed under more than one name: each later name maps to the
    first one (a tied causal LM: ``{"lm_head.weight": "model.embed_tokens.weight"}``; untied: ``{}``)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def untie(sd: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``sd`` without the aliases in ``tied`` (``tied_names``) whose parameter it holds under its first name."""
    return {k: v for k, v in sd.items() if not (k in tied and tied[k] in sd)}


def retie(sd: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``sd`` with each alias in ``tied`` that it lacks filled in as the same tensor as its first name (no copy)."""
    out = dict(sd)
    for alias, name in tied.items():
        if alias not in out and name in out:
            out[alias] = out[name]
    return out


def load_weights(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(sd)``, strict, except that a tied alias may be left out of ``sd`` when its first
    name is there (it is the same parameter, loaded once). A name missing otherwise, or one ``model`` lacks,
    fails loudly: a mismatched checkpoint must never load halfway."""
    tied = tied_names(model)
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not (k in tied and tied[k] in sd)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"loading weights into {type(model).__name__}: missing {missing}, "
                           f"unexpected {list(result.unexpected_keys)}")
