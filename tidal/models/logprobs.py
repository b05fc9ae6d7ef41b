"""Per-token log-probabilities and entropies of given sequences under a causal LM: exact and memory-bounded.

``logp_bt[:, t]`` is log p(input_ids[:, t] | input_ids[:, :t]); position 0 (nothing predicts it) is 0.
Logits are divided by the sampling temperature so trainer and engine score the same distribution.

Exact: the LM head and the log-softmax run in float32 whatever the model's dtype. MiniMax-M1 (arXiv
2506.13585, sec. 3.2, "Computational Precision Mismatch in Generation and Training", Fig. 3) traced the
training/inference probability mismatch to high-magnitude activations in the LM head and fixed it by
computing the head in FP32 (token-probability correlation 0.9x -> 0.99x). A bf16 head rounds each logit
to 8 significant bits, an error that grows with the logit's magnitude (tests/models/test_logprobs.py
measures it).

Memory-bounded: the naive path materializes [tokens x vocab] float32 logits, plus the same again for the
log-softmax and again for its gradient. With a 152k vocabulary, 16k tokens are 10 GB per copy. Here the
decoder's last hidden state [tokens x hidden] goes through the head ``chunk_size`` tokens at a time; each
chunk is run under ``torch.utils.checkpoint`` (non-reentrant), so the forward keeps only the chunk's
per-token outputs and the backward recomputes one chunk's logits at a time. Peak extra memory is a few
[chunk x vocab] blocks instead of a few [tokens x vocab] ones, for one extra head matmul per chunk in the
backward. docs/memory.md has the measured numbers.

Models that do not fit the Hugging Face causal-LM pattern (``get_decoder()`` + a linear
``get_output_embeddings()`` applied directly to the last hidden state) take the plain full-logits path.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tidal.utils.device import model_device

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per LM-head chunk. One float32 [1024 x vocab] block is 4 KiB per vocab entry: 128 MiB at a 32k
vocabulary, 594 MiB at Qwen2.5's 152k; the backward holds about three (measured, docs/memory.md). That
bounds the head's peak whatever the microbatch size, while each chunk's matmul stays one large GEMM
(1024 x hidden x vocab) rather than many small ones; at the tiny model's 51-token vocabulary a typical
microbatch is a handful of chunks."""

# Config fields of HF models that transform the head's output before the softmax (Gemma-2 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling); such models take the full-logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    position_ids: torch.Tensor | None = None,
    parents_bt: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``logp_bt`` [B, T] (float32, differentiable) and, if asked, entropies [B, T]
    (float32; no gradient unless ``entropy_grad``, for an entropy bonus: the metric alone keeps no graph
    and costs no backward). ``attention_mask_bt`` and ``position_ids`` [B, T] go to the model unchanged,
    so a packed batch can pass per-sequence position ids and a block-causal [B, 1, T, T] mask (or, on
    transformers versions that detect packing from position ids, no mask), or a dict of such masks keyed
    by layer type (``train/packing.py``'s ``packed_attention_mask`` for sliding-window models).

    ``parents_bt`` [B, T] names each token's predecessor by its column (-1: none, log-prob 0), for
    layouts where it is not the column before: prefix-shared tries (``train/prefix_tree.py``). Each
    token is then scored from its parent's output. Default: the column before."""
    assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
    device = model_device(model)  # inputs built on the host (packing, tries) go where the weights are
    input_ids_bt, position_ids, parents_bt = (x.to(device) if x is not None else None
                                              for x in (input_ids_bt, position_ids, parents_bt))
    if isinstance(attention_mask_bt, dict):  # one mask per layer type (sliding windows, ``models/architecture.py``)
        attention_mask_bt = {kind: mask.to(device) for kind, mask in attention_mask_bt.items()}
    elif attention_mask_bt is not None:
        attention_mask_bt = attention_mask_bt.to(device)
    head = _linear_head(model)
    if head is None:
        extra = {} if position_ids is None else {"position_ids": position_ids}
        out_btx = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt, **extra).logits
    else:
        out = model.get_decoder()(input_ids=input_ids_bt, attention_mask=attention_mask_bt,
                                  position_ids=position_ids, use_cache=False)
        out_btx = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if parents_bt is None:  # the column before predicts each token; nothing predicts column 0
        preceding, targets = out_btx[:, :-1], input_ids_bt[:, 1:]
    else:
        index = parents_bt.clamp(min=0)[..., None].expand(-1, -1, out_btx.shape[-1])
        preceding, targets = out_btx.gather(1, index), input_ids_bt
    if head is None:
        logp, ent = _logp_and_entropy(preceding.float(), targets, temperature, with_entropy, entropy_grad)
    else:
        logp, ent = chunked_head_logprobs(preceding, head.weight, head.bias, targets, temperature,
                                          with_entropy, chunk_size, entropy_grad)
    if parents_bt is None:
        return torch.nn.functional.pad(logp, (1, 0)), torch.nn.functional.pad(ent, (1, 0)) if with_entropy else None
    orphan = parents_bt < 0
    return logp.masked_fill(orphan, 0.0), ent.masked_fill(orphan, 0.0) if with_entropy else None


def chunked_head_logprobs(
    hidden_bth: torch.Tensor,
    weight_vh: torch.Tensor,
    bias_v: torch.Tensor | None,
    targets_bt: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T + bias)[target] per position, in float32, ``chunk_size`` positions at
    a time; returns ([B, T] log-probs, [B, T] entropies or None; differentiable if ``entropy_grad``)."""
    b, t, h = hidden_bth.shape
    # Cast once, outside the chunks: a bf16 weight's gradient is then summed over chunks in float32 and
    # rounded to bf16 once, as in the unchunked head, rather than once per chunk.
    hidden_nh = hidden_bth.reshape(b * t, h).float()
    weight_vh = weight_vh.float()
    bias_v = bias_v.float() if bias_v is not None else None
    targets_n = targets_bt.reshape(b * t)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden_nh, weight_vh, bias_v))
    logps, ents = [], []
    for start in range(0, b * t, chunk_size):
        args = (hidden_nh[start:start + chunk_size], weight_vh, bias_v, targets_n[start:start + chunk_size],
                temperature, with_entropy, entropy_grad)
        if needs_grad:
            logp_n, ent_n = checkpoint(_head_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            logp_n, ent_n = _head_chunk(*args)
        logps.append(logp_n)
        ents.append(ent_n)
    logp_bt = torch.cat(logps).reshape(b, t)
    ent_bt = torch.cat(ents).reshape(b, t) if with_entropy else None
    return logp_bt, ent_bt


def _head_chunk(hidden_nh, weight_vh, bias_v, targets_n, temperature, with_entropy, entropy_grad):
    # Under a caller's bf16 autocast the matmul would silently drop back to bf16: keep the head in fp32.
    with torch.autocast(hidden_nh.device.type, enabled=False):
        logits_nv = torch.nn.functional.linear(hidden_nh, weight_vh, bias_v)
        return _logp_and_entropy(logits_nv, targets_n, temperature, with_entropy, entropy_grad)


def _logp_and_entropy(logits, targets, temperature, with_entropy, entropy_grad=False):
    """Log-prob of ``targets`` under softmax(logits / T) over the last dim, and its entropy (with a
    gradient only if ``entropy_grad``)."""
    if temperature not in (0.0, 1.0):  # 0 means greedy sampling, which scores the unscaled logits
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head if logits are exactly ``head(decoder(...).last_hidden_state)``, else None."""
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if get_head is None or get_decoder is None:
        return None
    head = get_head()
    if not isinstance(head, torch.nn.Linear) or get_decoder() is model:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head
