"""The engine's LM head in fp32 on a lower-precision engine (``rollout.head_dtype=fp32``).

Why: a bf16 engine casts its whole copy of the model, the head included, while the trainer scores with an fp32
head. tidal's measurement of a bf16-rounded Qwen-sized head is 1.2e-2 mean log-prob error, ~16x the bf16 body's
gap (issue 51): on a real model the head would dominate ``train/logp_mismatch_mean``. The head is one matmul per
sampled token, so keeping its weights in fp32 (and its input upcast, fp32 accumulation) costs little.

A tied head (SmolLM2, Qwen2-0.5B) shares its tensor with the input embedding, which must stay in the body's
dtype; the fp32 head is then its own copy, and a weight update that names the embedding only (``models/tied.py``)
loads it into both (``fill_head``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tidal.models.tied import retie, tied_names

HEAD_DTYPES = ("auto", "fp32")


def keep_head_fp32(model: torch.nn.Module) -> dict[str, str]:
    """Make ``model``'s output embedding an fp32 ``Linear`` that upcasts its input, after the body was cast to a
    lower precision; untie it from the input embedding first. Returns the ties it undid (``{alias: name}``, as
    ``tied_names``) for ``fill_head``."""
    head = model.get_output_embeddings()
    ties = {alias: name for alias, name in tied_names(model).items() if alias.endswith(_head_weight_name(model))}
    weight = torch.nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)
    head.weight = weight  # untied: the input embedding keeps the body's dtype
    if getattr(head, "bias", None) is not None:
        head.bias = torch.nn.Parameter(head.bias.detach().float().clone(), requires_grad=False)
    head.register_forward_pre_hook(_upcast_input)
    return ties


def fill_head(state_dict: Mapping[str, torch.Tensor], ties: Mapping[str, str]) -> Mapping[str, torch.Tensor]:
    """A weight update that sends a tied head as its embedding only also loads the untied fp32 head."""
    return retie(state_dict, ties) if ties else state_dict


def _head_weight_name(model: torch.nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(f"{name}.weight" for name, m in model.named_modules() if m is head)


def _upcast_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])
