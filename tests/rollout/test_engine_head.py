"""``rollout.head_dtype=fp32``: a bf16 engine's LM head in fp32 (``rollout/head.py``)."""

import pytest
import torch

from tidal.models.logprobs import token_logprobs
from tidal.models.tied import tied_names, untie
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


@torch.no_grad()
def _gap(engine, model, requests) -> float:
    """Mean |engine log-prob - fp32 model log-prob| over the engine's sampled tokens."""
    gaps = []
    for t in engine.generate(requests):
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        gaps.append((logp[0, len(t.prompt_ids) :] - torch.tensor(t.logprobs)).abs())
    return float(torch.cat(gaps).mean())


def test_fp32_head_brings_a_bf16_engine_closer_to_the_fp32_model(small_model, tokenizer):
    requests = group_requests(tokenizer, [Prompt(f"p{i}", f"{i * 7}+{i}=", "") for i in range(8)], 2)
    bf16 = _gap(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=16, dtype="bf16")),
                small_model, requests)
    fp32_head = _gap(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=16, dtype="bf16",
                                                                          head_dtype="fp32")), small_model, requests)
    assert fp32_head < bf16, (fp32_head, bf16)
    print(f"mean |engine - fp32 model| log-prob: bf16 head {bf16:.2e}, fp32 head {fp32_head:.2e}")


def test_fp32_head_keeps_the_body_in_bf16_and_takes_weight_updates(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=4, dtype="bf16", head_dtype="fp32"))
    head, embed = engine.model.get_output_embeddings(), engine.model.get_input_embeddings()
    assert head.weight.dtype == torch.float32 and embed.weight.dtype == torch.bfloat16
    assert head.weight.data_ptr() != embed.weight.data_ptr()
    assert engine._head_ties == tied_names(small_model) != {}, "the tiny model's head is tied: the test covers untying"
    assert next(small_model.parameters()).dtype == torch.float32, "the engine changed the policy, not its copy"
    sd = {k: v + 0.01 for k, v in small_model.state_dict().items()}
    sent = untie(sd, tied_names(small_model))  # a tied head arrives as its embedding only
    engine.request_weight_update(sent, version=1)
    assert engine._apply_pending_update()
    head_name = next(k for k in sd if k.endswith("lm_head.weight"))
    assert torch.equal(head.weight, sd[head_name].float())
    assert engine.generate(group_requests(tokenizer, [Prompt("p", "1+1=", "")], 1))[0].token_ids


def test_fp32_head_is_a_no_op_on_an_fp32_engine_and_unknown_values_fail(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(dtype="fp32", head_dtype="fp32"))
    assert engine._head_ties == {} and not engine.model.get_output_embeddings()._forward_pre_hooks
    with pytest.raises(ValueError, match="rollout.head_dtype"):
        LocalEngine(small_model, tokenizer, SamplingConfig(head_dtype="fp16"))
