"""The slot cache sized once per call from its requests (``rollout/sizing.py``, issue 51): nothing grows during
the call, a second call of the same shape allocates nothing, every decode bucket is built once when the cache is
sized, and the samples are exactly those of the growing (doubling) path it replaces."""

import copy

import pytest
import torch

from tidal.api import GenRequest
from tidal.rollout.graphs import bucket
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.sizing import slot_shape
from tidal.rollout.slots import SlotCache
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)


def _requests(tokenizer, n_prompts=7, group=3):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def _engine(model, tokenizer, up_front=True, **cfg):
    """An engine that sizes its slot cache up front, or (``up_front=False``) grows it by doubling from 8 columns, so
    that the growing path of the comparisons reallocates several times."""
    engine = LocalEngine(model, tokenizer, SamplingConfig(**cfg))
    engine.size_up_front = up_front
    if not up_front:
        engine._slots = SlotCache(engine.model, engine.cfg.max_batch_size, min_columns=8)
    return engine


def _exact(a_runs, b_runs, atol=0.0):
    """Same samples; log-probs bit for bit (``atol`` 0: sizing changes no column span a step reads)."""
    for a, b in zip(a_runs, b_runs, strict=True):
        assert a.token_ids == b.token_ids and a.versions == b.versions and a.finish_reason == b.finish_reason
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= atol


def test_slot_shape_is_the_longest_prompt_plus_budget():
    prompt = Prompt("p", "", "")
    reqs = [GenRequest(prompt, (1,) * 5, 0), GenRequest(prompt, (1,) * 3, 1, max_new_tokens=20)]
    # one wave: the longest sequence is 3 + 20 (its own budget beats 5 + 8)
    assert slot_shape(reqs, 8, max_rows=4, draft_tokens=0, joins_later=False, quantum=1) == (2, 23)
    # more requests than slots: rows join later and the span moves, so 64 columns of room for the moves
    assert slot_shape(reqs, 8, max_rows=1, draft_tokens=0, joins_later=False, quantum=1) == (1, 87)
    assert slot_shape(reqs, 8, max_rows=4, draft_tokens=0, joins_later=True, quantum=1) == (2, 87)
    # speculative: rows of different progress on one write column, each with up to 4 drafts
    assert slot_shape(reqs, 8, max_rows=4, draft_tokens=4, joins_later=False, quantum=1) == (2, 27)
    assert slot_shape(reqs, 8, max_rows=1, draft_tokens=4, joins_later=False, quantum=1) == (1, 91)
    # rounded up to whole quanta, so that a slightly longer prompt in a later call fits what is allocated
    assert slot_shape(reqs, 8, max_rows=4, draft_tokens=0, joins_later=False) == (2, 64)
    assert slot_shape(reqs, 8, max_rows=4, draft_tokens=0, joins_later=False, quantum=16) == (2, 32)


@pytest.mark.parametrize("max_batch_size", [32, 5], ids=["one-wave", "refills"])
def test_a_call_is_sized_once_and_a_second_allocates_nothing(small_model, tokenizer, max_batch_size):
    requests = _requests(tokenizer)
    engine = _engine(small_model, tokenizer, max_new_tokens=24, max_batch_size=max_batch_size)
    first = engine.generate(requests)
    cache = engine._slots
    rows, columns = slot_shape(requests, 24, max_batch_size, 0, joins_later=False)
    longest = max(len(t.prompt_ids) + t.num_tokens for t in first)
    assert (cache.num_growths, cache.num_sizings) == (0, 1), "the call grew its buffers"
    assert len(cache.start) == rows == min(len(requests), max_batch_size)
    assert cache.columns == columns >= longest - 1  # the last sampled token is never fed
    assert columns <= max(len(r.prompt_ids) for r in requests) + 24 + 64 + 63
    generation, pointer = cache.generation, cache.kv.data_ptr()
    again = engine.generate(requests)
    assert engine._slots is cache and (cache.generation, cache.kv.data_ptr()) == (generation, pointer)
    assert engine.stats()["rollout/slot_resizes"] == 0.0
    _exact(first, again)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_sized_samples_are_the_growing_paths_samples(small_model, tokenizer, greedy):
    requests = _requests(tokenizer)
    runs = {}
    for up_front in (True, False):
        engine = _engine(small_model, tokenizer, up_front, max_new_tokens=40, max_batch_size=5)
        runs[up_front] = engine.generate(requests, greedy=greedy)
        growths = engine._slots.num_growths
        assert (growths == 0) if up_front else (growths > 0), "the growing path must grow for the comparison"
    _exact(runs[True], runs[False])


@pytest.mark.parametrize("max_batch_size", [32, 6], ids=["one-wave", "refills"])
def test_speculative_and_an_inflight_weight_update_sample_alike(small_model, tokenizer, max_batch_size):
    model = copy.deepcopy(small_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)  # peaked outputs: drafts get accepted and rejected (test_speculative.py)
    new = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(0))
           for k, v in model.state_dict().items()}
    runs = {}
    for up_front in (True, False):
        engine = _engine(model, tokenizer, up_front, max_new_tokens=30, max_batch_size=max_batch_size,
                         speculative=NGRAM)
        apply, calls = engine._apply_pending_update, []

        def interrupt(engine=engine, apply=apply, calls=calls):
            calls.append(1)
            if len(calls) == 5:
                engine.request_weight_update(new, version=3)
            return apply()

        engine._apply_pending_update = interrupt
        runs[up_front] = engine.generate(_requests(tokenizer))
        assert engine.num_interruptions == 1 and engine._spec.num_verify_steps > 0
        if up_front:
            assert engine._slots.num_growths == 0
    assert any(len(set(t.versions)) == 2 for t in runs[True])
    # rolled-back drafts stay in the span a step reads until compacted, and when that happens depends on the buffer
    # width: the same masked-out columns, summed in another order (test_speculative.py's tolerance for the same)
    _exact(runs[True], runs[False], atol=1e-5)


def test_a_longer_context_arriving_mid_stream_still_grows(small_model, tokenizer):
    """A stream is sized as its requests arrive: a much longer prompt joining while rows run outgrows the sizing
    of the first ones, and the buffers grow (counted) with the samples unchanged."""
    texts = [f"{i}+{i}=" for i in range(6)] + ["1234567890" * 10 + "="]  # 1 + 101 + 12 > the first rows' 128
    requests = group_requests(tokenizer, [Prompt(f"p{i}", t, "") for i, t in enumerate(texts)], 2)
    runs, growths = {}, {}
    for up_front in (True, False):
        engine = _engine(small_model, tokenizer, up_front, max_new_tokens=12, max_batch_size=5)
        queue, got = list(requests), {}

        def source(n, block, queue=queue):
            if not queue:
                return None
            taken, queue[:] = queue[: min(n, 2)], queue[min(n, 2) :]
            return taken

        engine.stream(source, lambda r, t, got=got: got.__setitem__(id(r), t))
        runs[up_front] = [got[id(r)] for r in requests]
        growths[up_front] = engine.stats()["rollout/slot_resizes"]
        if up_front:
            assert engine._slots.columns >= 102 + 12 + 64  # grown for the long prompt, with room for moves
    assert growths[True] >= 1
    _exact(runs[True], runs[False])


def test_every_bucket_is_built_once_when_the_cache_is_sized(small_model, tokenizer):
    """Static decode (CUDA graphs on a GPU; the same steps run eagerly here): each bucket the call's rows pass
    through is built when the slot cache is sized, none in the middle of decoding, and none again next call."""
    requests = _requests(tokenizer)  # 21 rows, all in one wave
    engine = _engine(small_model, tokenizer, cuda_graphs="on", max_new_tokens=24)
    engine.prepare(requests)
    static = engine._slots.static
    buckets = {bucket(n, len(requests)) for n in range(1, len(requests) + 1)}
    assert static.num_built == len(buckets) == 6 and {rows for rows, _ in static._steps} == buckets  # 1, 2, .., 21
    engine.generate(requests)
    engine.generate(requests)
    stats = engine.stats()
    assert static.num_built == len(buckets) and stats["rollout/graph_late_steps"] == 0.0
    assert stats["rollout/slot_resizes"] == 0.0
    dynamic = _engine(small_model, tokenizer, cuda_graphs="off", max_new_tokens=24).generate(requests)
    static_run = engine.generate(requests)
    assert [t.token_ids for t in static_run] == [t.token_ids for t in dynamic]
