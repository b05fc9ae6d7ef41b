"""The attention layout read from each family's config, the per-layer-type masks (windows over positions, by
hand), and the one check that refuses, in one line naming the feature, what tidal would compute wrongly."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralModel

from tidal.models.architecture import (
    AttentionLayout,
    UnsupportedArchitecture,
    _takes_mask_dict,
    attention_layout,
    check_architecture,
)

from .architectures import WINDOW, build, config_for


@pytest.mark.parametrize("family, windows", [
    ("llama", {"full_attention": None}),
    ("qwen3", {"full_attention": None}),
    ("mistral", {"sliding_attention": WINDOW}),  # no layer_types: config.sliding_window on every layer
    ("qwen2", {"full_attention": None, "sliding_attention": WINDOW}),  # layers >= max_window_layers slide
    ("gemma3", {"sliding_attention": WINDOW, "full_attention": None}),
])
def test_layout_per_family(tokenizer, family, windows):
    layout = attention_layout(config_for(family, tokenizer))
    assert layout.windows == windows and layout.sliding == (WINDOW in windows.values())
    check_architecture(build(family, tokenizer))  # every claimed family passes the check


def test_masks_are_windows_over_positions_not_columns():
    """One row whose positions restart (two packed sequences): a key is in the window when its position is
    less than ``window`` behind the query's, and the full mask is kept for full-attention layers."""
    full = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    layout = AttentionLayout({"full_attention": None, "sliding_attention": 2})
    masks = layout.masks(full, pos, pos)
    assert masks["full_attention"] is full
    want = torch.tensor([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0],  # position 0 again: q - k <= 0 for every earlier key (full decides)
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(masks["sliding_attention"][0, 0], want & full[0, 0])
    assert AttentionLayout({"sliding_attention": 2}).masks(full, pos, pos).shape == full.shape  # one mask
    assert AttentionLayout({"full_attention": None}).masks(full, pos, pos) is full  # nothing built


def _with(config, **attrs):
    config = copy.deepcopy(config)
    for k, v in attrs.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize("attrs, feature", [
    (dict(attn_logit_softcapping=50.0), "attention logit softcapping"),
    (dict(attention_chunk_size=8192), "chunked attention"),
    (dict(kv_lora_rank=512), "multi-head latent attention"),
    (dict(is_encoder_decoder=True), "cross attention"),
    (dict(cross_attention_layers=[3, 8]), "cross attention"),
    (dict(use_bidirectional_attention=True), "bidirectional attention"),
    (dict(alibi=True), "ALiBi"),
    (dict(num_kv_shared_layers=10), "KV sharing across layers"),
    (dict(hybrid_override_pattern="M-M*"), "recurrent or state-space layers"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "RoPE scaling that depends on the seq"),
    (dict(layer_types=["full_attention", "linear_attention"]), "layer type 'linear_attention' is not supported"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "layer type 'chunked_attention'"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None),
     "sliding_attention layers without config.sliding_window"),
])
def test_each_unsupported_feature_is_refused_in_one_line(tokenizer, attrs, feature):
    model = build("llama", tokenizer)
    model.config = _with(model.config, **attrs)
    with pytest.raises(UnsupportedArchitecture, match=f"^LlamaForCausalLM: {feature}") as e:
        check_architecture(model)
    assert "\n" not in str(e.value)


def test_attention_sinks_are_refused(tokenizer):
    model = build("llama", tokenizer)
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))  # GPT-OSS's learned sink logits
    with pytest.raises(UnsupportedArchitecture, match="attention sinks"):
        check_architecture(model)


def test_mixed_layers_need_a_forward_that_takes_a_mask_dict(tokenizer):
    """A mixed layout's masks go as a dict keyed by layer type; Mistral's forward takes one mask only, so
    Mistral with layer_types would be refused rather than handed a dict it cannot read."""
    assert _takes_mask_dict(type(build("gemma3", tokenizer).model))
    assert _takes_mask_dict(type(build("qwen2", tokenizer).model))
    assert not _takes_mask_dict(MistralModel)
    model = build("mistral", tokenizer)
    model.config = _with(model.config, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UnsupportedArchitecture, match="mixed layer types .* takes no per-layer-type mask dict"):
        check_architecture(model)


def test_static_rope_scaling_passes(tokenizer):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert check_architecture(AutoModelForCausalLM.from_config(config)).windows == {"full_attention": None}
