"""enable_activation_checkpointing with our call pattern (token_logprobs in training mode): the same
gradients, bit for bit, and a lower activation peak."""

import warnings

import pytest
import torch

from tidal.models import tiny
from tidal.models.checkpointing import enable_activation_checkpointing
from tidal.models.logprobs import token_logprobs
from tidal.utils.memory import tensor_peak_bytes

CFG = tiny.ModelConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=256,
                       max_position_embeddings=256)


def step(model, ids, mask):
    token_logprobs(model, ids, mask)[0].sum().backward()


def test_same_gradients_and_a_lower_peak(tokenizer):
    ids = torch.randint(3, len(tokenizer), (4, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    plain = tiny.build_model(CFG, tokenizer).train()
    ckpt = tiny.build_model(CFG, tokenizer).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a deprecation nor a "use_cache" warning on our path
        enable_activation_checkpointing(ckpt)
        peak_plain = tensor_peak_bytes(lambda: step(plain, ids, mask))
        peak_ckpt = tensor_peak_bytes(lambda: step(ckpt, ids, mask))
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=f"gradient of {name}")
    # Measured (4 x 128 tokens, 4 layers): 15.0 MB without, 5.5 MB with.
    assert peak_ckpt < 0.6 * peak_plain, (peak_plain, peak_ckpt)


def test_eval_and_no_grad_scoring_are_unchanged(tokenizer, batch):
    ids, mask = batch
    ref = tiny.build_model(CFG, tokenizer).eval()
    ckpt = tiny.build_model(CFG, tokenizer)
    enable_activation_checkpointing(ckpt)
    with torch.no_grad():
        expected = token_logprobs(ref, ids, mask)[0]
        torch.testing.assert_close(token_logprobs(ckpt.eval(), ids, mask)[0], expected, rtol=0, atol=0)
        torch.testing.assert_close(token_logprobs(ckpt.train(), ids, mask)[0], expected, rtol=0, atol=0)


def test_a_model_without_the_switch_is_refused():
    with pytest.raises(TypeError, match="not a Hugging Face model"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))
