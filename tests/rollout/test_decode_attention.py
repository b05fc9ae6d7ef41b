"""``rollout.decode_attention`` (``rollout/decode_attention.py``): attention over grouped KV heads without
``repeat_kv`` samples what transformers' SDPA samples, through every engine path (rows joining and leaving, shared
rows, speculative verify steps, static decode, sliding-window layers), and never runs ``repeat_kv``.

Tolerances: tokens exactly; log-probs within ``LOGP_ATOL``. One masked call agrees with transformers' SDPA to
1e-6, but the arms order their sums differently (``fold`` splits the work over other rows, and transformers >= 5.24
itself folds a single query token, ``pack_gqa``, where ``gqa`` does not), so log-probs move by ~2e-6."""

import copy
import dataclasses
import logging

import pytest
import torch
from transformers.integrations import sdpa_attention

from tidal.models.attention import use_packed_attention
from tidal.rollout import decode_attention
from tidal.rollout.decode_attention import fold_attention_forward, gqa_attention_forward
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

from ..models.architectures import build

LOGP_ATOL = 1e-5
"""fp32 log-probs of the same tokens through differently ordered sums differ by ~1e-6."""
MODES = ("gqa", "fold")


@pytest.fixture(scope="module")
def models(tokenizer):
    """4 query heads over 2 KV heads: llama (full attention), qwen2 (a full layer, then windowed ones) and gemma3
    (local and global layer types, each its own mask)."""
    return {family: build(family, tokenizer) for family in ("llama", "qwen2", "gemma3")}


class _Module:
    num_key_value_groups = 3


def _requests(tokenizer, n_prompts=5, group=2):
    """10 requests of different prompt lengths and token budgets through 4 slots: rows finish at different steps
    (random models rarely sample EOS) and later ones join into the freed slots."""
    prompts = [Prompt(f"p{i}", "12+34=" * (1 + i % 4) + str(i), "") for i in range(n_prompts)]
    return [dataclasses.replace(r, max_new_tokens=None if i % 3 == 0 else 5 + i) for i, r in
            enumerate(group_requests(tokenizer, prompts, group))]


def _run(model, tokenizer, mode: str, greedy: bool = False, **cfg):
    cfg = {"max_new_tokens": 14, "max_batch_size": 4, **cfg}
    engine = LocalEngine(model, tokenizer, SamplingConfig(decode_attention=mode, **cfg))
    return engine, engine.generate(_requests(tokenizer), greedy=greedy)


_REPEAT: dict[tuple, list] = {}


def _repeat(model, tokenizer, greedy: bool = False, **cfg):
    """``repeat``'s generations, run once per model and settings in this module."""
    key = (id(model), greedy, repr(sorted(cfg.items())))
    if key not in _REPEAT:
        _REPEAT[key] = _run(model, tokenizer, "repeat", greedy, **cfg)[1]
    return _REPEAT[key]


def _assert_same(got, want):
    assert [t.token_ids for t in got] == [t.token_ids for t in want]
    worst = max(max((abs(a - b) for a, b in zip(x.logprobs, y.logprobs)), default=0.0) for x, y in zip(got, want))
    assert worst <= LOGP_ATOL, worst


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("forward", [gqa_attention_forward, fold_attention_forward])
def test_forward_equals_transformers_sdpa(forward, q):
    """One masked call on a strided K/V view (as the slot cache hands it), 6 query heads over 2 KV heads: the output
    of transformers' SDPA (which repeats K and V), its layout [B, q, H, D]."""
    torch.manual_seed(0)
    query = torch.randn(3, q, 6, 8).transpose(1, 2)  # [B, H, q, D], strided as the models' projections make it
    key, value = (torch.randn(5, 2, 20, 8)[:3, :, 2:17] for _ in range(2))
    mask = torch.rand(3, 1, q, 15) > 0.3
    mask[..., 0] = True  # no empty row
    want, _ = sdpa_attention.sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
    got, _ = forward(_Module(), query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (3, q, 6, 8) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fold_leaves_wide_forwards_to_transformers():
    """A fold copies the mask n_rep times: past the K/V copy it saves (a long prefill) it is not done."""
    key = torch.zeros(1, 2, 4, 8)
    assert decode_attention._fold_pays(torch.zeros(1, 6, 1, 8), key)
    assert decode_attention._fold_pays(torch.zeros(1, 6, 32, 8), key)  # 3 x 32 <= 2 x 6 x 8 x 4 bytes
    assert not decode_attention._fold_pays(torch.zeros(1, 6, 200, 8), key)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_engine_samples_what_repeat_samples(models, tokenizer, mode, family):
    """Greedy and sampled generations, rows joining into freed slots and shared rows (a group's samples share
    their prompt): the same tokens and log-probs as ``repeat``; windowed layers stay exact."""
    model = models[family]
    for greedy in (True, False):
        want = _repeat(model, tokenizer, greedy)
        engine, got = _run(model, tokenizer, mode, greedy)
        assert engine.model.config._attn_implementation == decode_attention.NAMES[mode]
        _assert_same(got, want)
    assert len({t.num_tokens for t in got}) > 1, "rows must finish at different steps"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_speculative_static_and_unshared_decoding_sample_what_repeat_samples(models, tokenizer, mode, family):
    """Speculative verify steps (several query tokens per row, rolled-back drafts masked), static-shape decode (its
    whole-width masks; CUDA graphs on a GPU, eager here) and every row decoded on its own."""
    model = models[family]
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)
    for cfg in (dict(speculative=spec, temperature=0.3, max_new_tokens=30), dict(cuda_graphs="on"),
                dict(share_identical_rows=False)):
        want = _repeat(model, tokenizer, **cfg)
        engine, got = _run(model, tokenizer, mode, **cfg)
        _assert_same(got, want)
        if "speculative" in cfg:
            assert 0 < engine._spec.num_accepted < engine._spec.num_drafted  # drafts both kept and rolled back
        if "cuda_graphs" in cfg:
            assert engine._slots.static is not None


@pytest.mark.parametrize("mode", MODES)
def test_no_repeat_kv_runs(models, tokenizer, monkeypatch, mode):
    """With ``repeat`` the engine's masked calls copy K and V (prefill over padded prompts, verify steps); with
    ``gqa`` or ``fold`` nothing does, in prefill, plain, speculative or static decoding."""
    calls = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)
    _run(models["qwen2"], tokenizer, "repeat", speculative=spec)
    assert calls, "the patch must catch transformers' repeat_kv"

    def refuse(*args):
        raise AssertionError("repeat_kv ran")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", refuse)
    for cfg in (dict(), dict(speculative=spec, temperature=0.3, max_new_tokens=30), dict(cuda_graphs="on")):
        _run(models["qwen2"], tokenizer, mode, **cfg)


def test_packed_attention_policy_and_its_copy(models, tokenizer):
    """A trainer model switched to ``tidal_packed`` keeps it; the engine's copy runs the GQA forward."""
    model = copy.deepcopy(models["llama"])
    assert use_packed_attention(model)
    want = _repeat(models["llama"], tokenizer)
    engine, got = _run(model, tokenizer, "gqa")
    assert engine.model.config._attn_implementation == "tidal_gqa"
    assert model.config._attn_implementation == "tidal_packed"
    _assert_same(got, want)


def test_bad_value_is_refused_naming_the_key(models, tokenizer):
    with pytest.raises(ValueError, match=r"^rollout\.decode_attention='paged': one of repeat, gqa, fold$"):
        LocalEngine(models["llama"], tokenizer, SamplingConfig(decode_attention="paged"))


def test_run_config_refuses_a_bad_value_before_any_work():
    from tidal.config import ConfigError, apply_overrides
    from tidal.system.config import RunConfig
    from tidal.system.validate import validate_run_config

    validate_run_config(apply_overrides(RunConfig(), ["rollout.decode_attention=fold"]))
    with pytest.raises(ConfigError, match=r"^rollout\.decode_attention='gqa2': one of repeat, gqa, fold$"):
        validate_run_config(apply_overrides(RunConfig(), ["rollout.decode_attention=gqa2"]))


def test_without_enable_gqa_gqa_falls_back_to_repeat_and_says_why(models, tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(decode_attention, "supports_enable_gqa", lambda: False)
    with caplog.at_level(logging.WARNING, logger=decode_attention.__name__):
        engine = LocalEngine(models["llama"], tokenizer, SamplingConfig(decode_attention="gqa"))
    assert engine.model.config._attn_implementation == "sdpa"
    assert "needs torch >= 2.5" in caplog.text


def test_default_is_repeat_and_this_torch_has_enable_gqa():
    assert SamplingConfig().decode_attention == "repeat" and decode_attention.supports_enable_gqa()
