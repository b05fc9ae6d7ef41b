"""Tiny random models of each architecture family tidal claims, and transformers' own log-probs as the reference.

Each family is built with ``AutoModelForCausalLM.from_config`` on the character tokenizer's vocabulary: a few
layers, fp32, SDPA, with windows of a few tokens so that short test sequences run well past them. Weights are
drawn wider than transformers' default (std 0.02 leaves attention nearly uniform, and a wrong mask would then
move the log-probs by less than the tolerance): ``windowed_matters`` checks that dropping the windows changes
transformers' own log-probs by far more than the tests' tolerance.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

WINDOW = 5
"""The sliding window of the tiny windowed models: prompts of 10-30 characters run far past it."""

ATOL = 1e-4
"""fp32 log-probs of the same sequence through different layouts and kernels agree to ~1e-6; 1e-4 leaves room."""


def _common(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.3,
                attn_implementation="sdpa")


def config_for(family: str, tokenizer):
    """The tiny config of ``family``: llama, qwen3 (full attention), mistral (every layer windowed), qwen2
    (``use_sliding_window``: layer 0 full, the rest windowed) or gemma3 (Gemma3TextConfig: local, local,
    global layers, each type with its own RoPE base; qk-norm, embedding scaling, query_pre_attn_scalar)."""
    c = _common(tokenizer)
    if family == "llama":
        return LlamaConfig(num_hidden_layers=2, **c)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=2, head_dim=8, **c)
    if family == "mistral":
        return MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **c)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                           **c)
    if family == "gemma3":
        return Gemma3TextConfig(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                                **c)
    raise ValueError(family)


FAMILIES = ("llama", "qwen3", "mistral", "qwen2", "gemma3")
WINDOWED = ("mistral", "qwen2", "gemma3")


def build(family: str, tokenizer, seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config_for(family, tokenizer), dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """transformers' own forward over one whole sequence (no cache, no mask, no padding): log p(ids[t] | ids[:t])
    for t >= 1 under softmax(logits / temperature), as a float32 [len(ids) - 1] tensor."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    logits = model(input_ids=x).logits[0, :-1].float() / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].cpu()


@torch.no_grad()
def windowed_matters(model: torch.nn.Module, ids: list[int]) -> float:
    """How far transformers' log-probs of ``ids`` move when the model's windows are dropped (every layer full
    attention): the size of the error a mask that ignored the windows would make."""
    config, saved = model.config, model.config.sliding_window
    windowed = reference_logprobs(model, ids)
    config.sliding_window = 10**6
    try:
        return float((reference_logprobs(model, ids) - windowed).abs().max())
    finally:
        config.sliding_window = saved
