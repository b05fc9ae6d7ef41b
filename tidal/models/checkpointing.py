"""Activation checkpointing for Hugging Face causal LMs: keep each decoder layer's input, recompute its
inside during the backward.

Without it the backward needs every layer's intermediate activations (attention projections, MLP
hidden of width ``intermediate_size``, norms) for every token; with it, one hidden-state tensor per layer
plus one layer's intermediates at a time, for about one extra forward of compute. Transformers wraps each
decoder layer in ``torch.utils.checkpoint`` when the model is in training mode (``model.train()``; eval
and generation are unaffected) and the layer is called without a KV cache, which is how
``tidal.models.logprobs.token_logprobs`` calls it (``use_cache=False``).

We ask for the non-reentrant variant: the PyTorch docs recommend it; the reentrant one gives no gradient
to a checkpointed block unless one of its inputs requires grad, and supports only ``backward()`` without
``inputs``. It is transformers' own default since the 5.x rename to ``activation_checkpointing_enable``;
we pass it explicitly because the older ``gradient_checkpointing_enable`` (transformers 4.x) defaulted to
the reentrant one.
"""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Turn on per-decoder-layer activation checkpointing (non-reentrant) on a Hugging Face model."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x; the 4.x name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face model: it has no activation "
                        "checkpointing switch (wrap its blocks in torch.utils.checkpoint yourself)")
