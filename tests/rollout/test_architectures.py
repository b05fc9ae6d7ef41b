"""The local engine on each architecture family tidal claims (``tests/models/architectures.py``): its per-token
log-probs equal transformers' own full-sequence forward on sequences far longer than the sliding window, rows
of different lengths in one batch, through every slot-cache path (rows joining and leaving, the span moving
and growing, shared rows, kept turns, speculative drafts rolled back and compacted, static decode); a model
it cannot run is refused with one line."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from tidal.api import GenRequest
from tidal.models.architecture import UnsupportedArchitecture
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

from ..models.architectures import ATOL, FAMILIES, WINDOW, WINDOWED, build, reference_logprobs, windowed_matters


@pytest.fixture(scope="module")
def models(tokenizer):
    return {family: build(family, tokenizer) for family in FAMILIES}


def _requests(tokenizer, n_prompts=6, group=2):
    """Prompts of 7 to 32 characters (the window is 5), two samples each."""
    prompts = [Prompt(f"p{i}", "12+34=" * (1 + i % 5) + str(i), "") for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def _worst(model, trajectories, temperature: float = 1.0) -> float:
    """The largest difference between an engine log-prob and transformers' forward over the whole sequence."""
    worst = 0.0
    for t in trajectories:
        ref = reference_logprobs(model, [*t.prompt_ids, *t.token_ids], temperature)[len(t.prompt_ids) - 1 :]
        worst = max(worst, float((ref - torch.tensor(t.logprobs)).abs().max()))
    return worst


def _stream(engine, requests, at_a_time: int, greedy: bool = False):
    """Requests joining ``at_a_time`` per step (rows finish and join mid-flight), results in request order."""
    queue, got = list(requests), {}

    def source(n, block):
        if not queue:
            return None
        taken, queue[:] = queue[: min(n, at_a_time)], queue[min(n, at_a_time) :]
        return taken

    engine.stream(source, lambda r, t: got.__setitem__((r.prompt.uid, r.sample_index), t), greedy)
    return [got[(r.prompt.uid, r.sample_index)] for r in requests]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("greedy", [True, False])
def test_engine_logprobs_equal_transformers_forward(models, tokenizer, family, greedy):
    model, requests = models[family], _requests(tokenizer)
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=16, max_batch_size=5))
    out = _stream(engine, requests, at_a_time=2, greedy=greedy)
    lengths = {len(t.prompt_ids) + t.num_tokens for t in out}
    assert len(lengths) > 3 and max(lengths) > 6 * WINDOW
    assert _worst(model, out) < ATOL
    if family in WINDOWED:  # a mask that ignored the windows would be off by far more than the tolerance
        assert windowed_matters(model, [*out[-1].prompt_ids, *out[-1].token_ids]) > 100 * ATOL


@pytest.mark.parametrize("family", WINDOWED)
def test_static_decode_and_unshared_rows(models, tokenizer, family):
    """Static-shape decode (CUDA graphs on a GPU; eager here) reads the whole buffer width: its per-layer-type
    masks are exact too. Rows that share contexts run once or each on its own: the same log-probs."""
    model, requests = models[family], _requests(tokenizer)
    for cfg in (dict(cuda_graphs="on"), dict(share_identical_rows=False)):
        engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=16, max_batch_size=5, **cfg))
        assert _worst(model, _stream(engine, requests, at_a_time=3)) < ATOL


@pytest.mark.parametrize("family", WINDOWED)
def test_speculative_rollbacks_and_compaction_keep_windows_over_positions(models, tokenizer, family):
    """Rolled-back drafts leave columns inside a row's span, so columns stop being positions: the window counts
    live columns. Samples equal plain decoding's and log-probs transformers'."""
    model, requests = models[family], _requests(tokenizer)
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)
    kw = dict(max_new_tokens=40, temperature=0.3)
    plain = LocalEngine(model, tokenizer, SamplingConfig(**kw)).generate(requests)
    engine = LocalEngine(model, tokenizer, SamplingConfig(speculative=spec, **kw))
    engine.size_up_front = False  # a buffer grown from 64 columns runs out, so the rolled-back columns are compacted
    drafted = engine.generate(requests)
    assert [t.token_ids for t in drafted] == [t.token_ids for t in plain]
    assert 0 < engine._spec.num_accepted < engine._spec.num_drafted  # drafts both kept and rolled back
    assert engine._slots.num_compactions > 0
    assert _worst(model, drafted, temperature=0.3) < ATOL


@pytest.mark.parametrize("family", WINDOWED)
def test_kept_turn_extends_into_the_next_turn(models, tokenizer, family):
    """An episode's next turn runs only its new tokens over the kept keys and values (``_prefill_after``)."""
    model = models[family]
    first = [GenRequest(r.prompt, r.prompt_ids, r.sample_index, max_new_tokens=9, episode=True)
             for r in _requests(tokenizer, n_prompts=3)]
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=9, temperature=0.0))
    one = engine.generate(first)
    obs = tuple(tokenizer("=5;", add_special_tokens=False).input_ids)
    second = [GenRequest(r.prompt, (*r.prompt_ids, *t.token_ids, *obs), r.sample_index, max_new_tokens=9, turn=1,
                         episode=True) for r, t in zip(first, one) if t.finish_reason == "length"]
    two = engine.generate(second)
    assert second and engine.num_reused_tokens > WINDOW * len(second)
    assert _worst(model, one + two) < ATOL


def test_eager_attention_runs_on_sdpa_in_the_engine(models, tokenizer):
    """Eager attention adds a mask to the scores; the engine's masks are booleans, so its private copy runs SDPA."""
    model = copy.deepcopy(models["gemma3"])
    model.set_attn_implementation("eager")
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=12))
    assert engine.model.config._attn_implementation == "sdpa" and model.config._attn_implementation == "eager"
    assert _worst(model, engine.generate(_requests(tokenizer))) < ATOL


def test_unsupported_model_is_refused_in_one_line(tokenizer):
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedArchitecture, match=r"^Gemma2ForCausalLM: attention logit softcapping") as e:
        LocalEngine(model, tokenizer, SamplingConfig())
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", WINDOWED)
def test_cuda_graph_decode_keeps_the_windows(models, tokenizer, family):
    """On CUDA the decode steps replay recorded graphs, with one static mask buffer per layer type."""
    model = models[family]
    engine = LocalEngine(copy.deepcopy(model).to("cuda"), tokenizer,
                         SamplingConfig(max_new_tokens=16, max_batch_size=5, dtype="fp32"))
    out = _stream(engine, _requests(tokenizer), at_a_time=2)
    assert engine._slots.static.num_recorded > 0 and not engine._slots.static.failed
    assert _worst(model, out) < 1e-3  # CUDA kernels against the CPU forward
