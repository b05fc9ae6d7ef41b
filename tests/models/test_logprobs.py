"""token_logprobs: the chunked FP32-head path equals the full-logits reference (values, entropies, gradients),
is more exact than a bf16 head, and passes position ids and 4-D masks through for packed batches."""

import pytest
import torch

from tidal.models import tiny
from tidal.models.logprobs import _linear_head, chunked_head_logprobs, token_logprobs


def reference(model, ids, mask, temperature=1.0):
    """The textbook computation: full [B, T, V] logits from the model's forward, log-softmax in float32."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.nn.functional.pad(logp, (1, 0)), torch.nn.functional.pad(ent.detach(), (1, 0))


def grads(model, logp_bt, weight_bt):
    model.zero_grad(set_to_none=True)
    (logp_bt * weight_bt).sum().backward()
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_entropies_and_gradients_match_the_full_logits_path(model, batch, temperature):
    ids, mask = batch
    weight_bt = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))  # an arbitrary upstream grad
    ref_logp, ref_ent = reference(model, ids, mask, temperature)
    ref_grads = grads(model, ref_logp, weight_bt)
    # 7 does not divide the 3 x 19 predicted positions: the last chunk is short.
    logp, ent = token_logprobs(model, ids, mask, temperature, with_entropy=True, chunk_size=7)
    assert logp.dtype == torch.float32 and logp.shape == ids.shape and (logp[:, 0] == 0).all()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-6)
    assert not ent.requires_grad, "entropy is a metric; it must not carry a graph"
    got = grads(model, logp, weight_bt)
    for name, g in ref_grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5 * scale + 1e-9, msg=f"gradient of {name}")


def test_entropy_grad_gives_the_full_logits_entropy_gradient(model, batch):
    """For an entropy bonus: with ``entropy_grad`` the chunked entropies carry the gradient of the
    textbook -sum p log p over the full logits (and the log-probs' gradient is unchanged)."""
    ids, mask = batch
    weight_bt = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    ref_ent = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    ref_grads = grads(model, ref_ent, weight_bt)
    _, ent = token_logprobs(model, ids, mask, with_entropy=True, chunk_size=7, entropy_grad=True)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-6)
    got = grads(model, ent, weight_bt)
    for name, g in ref_grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5 * scale + 1e-9, msg=f"gradient of {name}")


def test_chunk_size_does_not_change_the_result(model, batch):
    ids, mask = batch
    with torch.no_grad():
        one_chunk = token_logprobs(model, ids, mask, with_entropy=True)  # default 1024 > 57 positions
        per_token = token_logprobs(model, ids, mask, with_entropy=True, chunk_size=1)
    torch.testing.assert_close(per_token, one_chunk, rtol=0, atol=1e-6)


def test_models_that_do_not_fit_the_pattern_take_the_full_logits_path(model, batch):
    class Wrapped(torch.nn.Module):  # e.g. a DDP-style wrapper: no get_output_embeddings / get_decoder
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    ids, mask = batch
    assert _linear_head(Wrapped(model)) is None and _linear_head(model) is not None
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(Wrapped(model), ids, mask)[0], reference(model, ids, mask)[0],
                                   rtol=0, atol=1e-6)


def test_a_head_output_transform_in_the_config_disables_the_fast_path(tokenizer):
    m = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                          intermediate_size=64), tokenizer)
    m.config.final_logit_softcapping = 30.0  # Gemma-2 style: logits = 30 tanh(logits / 30) after the head
    assert _linear_head(m) is None


def test_fp32_head_is_closer_to_fp64_than_a_bf16_head(tokenizer):
    """MiniMax-M1's fix, measured. Logits are scaled to a trained LM's range (std ~2); the reference is the
    float64 head on the same bf16 hidden states, so the gap isolates the head's precision."""
    cfg = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)
    m = tiny.build_model(cfg, tokenizer)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(10.0)
    m = m.to(torch.bfloat16).eval()
    ids = torch.randint(3, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = m.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
        logits64 = hidden.double() @ m.get_output_embeddings().weight.double().T
        exact = torch.log_softmax(logits64, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        bf16_head = reference(m, ids, mask)[0][:, 1:]  # the model's own bf16 lm_head, softmax in fp32
        fp32_head = token_logprobs(m, ids, mask)[0][:, 1:]
    assert 1.5 < logits64.std() < 4
    err_bf16 = (bf16_head.double() - exact).abs()
    err_fp32 = (fp32_head.double() - exact).abs()
    # Measured: bf16 head mean 1.4e-2 / max 3.8e-2; fp32 head mean 6.7e-7 / max 3.1e-6.
    assert err_fp32.max() < 1e-5, err_fp32.max()
    assert err_bf16.mean() > 1000 * err_fp32.mean(), (err_bf16.mean(), err_fp32.mean())


def test_the_head_stays_fp32_under_a_callers_bf16_autocast():
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 9, 16, generator=gen), 3 * torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (2, 9), generator=gen)
    plain = chunked_head_logprobs(hidden, weight, None, targets, chunk_size=4)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = chunked_head_logprobs(hidden, weight, None, targets, chunk_size=4)[0]
    assert autocast.dtype == torch.float32
    torch.testing.assert_close(autocast, plain, rtol=0, atol=1e-6)


def test_bf16_model_gets_bf16_gradients_through_the_fp32_head(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    m = tiny.build_model(cfg, tokenizer).to(torch.bfloat16).train()
    ids = torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    logp, _ = token_logprobs(m, ids, torch.ones_like(ids), chunk_size=5)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all(), name


def test_packed_rows_with_position_ids_and_a_block_diagonal_mask_score_each_sequence_alone(model, tokenizer):
    """The packing contract: per-sequence position ids and a 4-D block-causal mask reach the decoder."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(3, len(tokenizer), (1, 10), generator=gen)
    b = torch.randint(3, len(tokenizer), (1, 12), generator=gen)
    with torch.no_grad():
        alone_a = token_logprobs(model, a, torch.ones_like(a))[0]
        alone_b = token_logprobs(model, b, torch.ones_like(b))[0]
        seg = torch.tensor([0] * 10 + [1] * 12)
        block_causal = (seg[:, None] == seg[None, :]) & torch.ones(22, 22, dtype=torch.bool).tril()
        position_ids = torch.cat([torch.arange(10), torch.arange(12)])[None]
        packed = token_logprobs(model, torch.cat([a, b], 1), block_causal[None, None], position_ids=position_ids)[0]
    torch.testing.assert_close(packed[:, 1:10], alone_a[:, 1:], rtol=0, atol=1e-5)
    # Position 10 is b's first token, "predicted" from a's last: meaningless, the loss mask drops it.
    torch.testing.assert_close(packed[:, 11:], alone_b[:, 1:], rtol=0, atol=1e-5)
