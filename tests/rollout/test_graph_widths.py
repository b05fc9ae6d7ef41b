"""Width buckets of the static decode step (``rollout.graph_widths=buckets``, ``rollout/graphs.py``, issue 51).

On the CPU the static step runs eagerly (no CUDA graphs), so the path a GPU replays is compared here: ``buckets``
samples the tokens ``full`` and the dynamic decode sample, with log-probs within 1e-5, through continuous batching
(rows joining into freed slots, the live span moved left), late host reads, speculative decoding's plain steps, an
MoE model's routes and sliding-window masks; and each step's attention sees the write column's width bucket, not
the whole buffer. ``MIN_WIDTH`` is lowered to 8 in most tests so the tiny model's short sequences pass through
several widths. The CUDA replay: ``test_buckets_replay_on_cuda`` (``-m gpu``, the device check's tests stage).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tidal.rollout import graphs
from tidal.rollout.graphs import width_bucket, width_buckets
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

from ..models.architectures import ATOL, WINDOWED, build
from .test_architectures import _requests as window_requests
from .test_architectures import _stream, _worst
from .test_engine_routes import check_routes, moe_model  # noqa: F401 (a fixture)
from .test_speculative import _requests as spec_requests
from .test_speculative import _same, peaked  # noqa: F401 (a fixture)

TOL = 1e-5


@pytest.fixture
def narrow(monkeypatch):
    """Width buckets from 8 columns: the tiny model's sequences then cross several of them."""
    monkeypatch.setattr(graphs, "MIN_WIDTH", 8)


def _requests(tokenizer, n_prompts=7, group=3):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def _same_samples(a, b) -> float:
    """The same tokens; returns the largest log-prob difference (asserted within ``TOL``)."""
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    worst = max(max((abs(x - y) for x, y in zip(p.logprobs, q.logprobs)), default=0.0) for p, q in zip(a, b))
    assert worst <= TOL, worst
    return worst


def _engine(model, tokenizer, widths: str | None, **cfg) -> LocalEngine:
    """``widths=None``: dynamic decode; else static decode (eager on the CPU) with ``rollout.graph_widths``."""
    graphs_cfg = dict(cuda_graphs="off") if widths is None else dict(cuda_graphs="on", graph_widths=widths)
    return LocalEngine(model, tokenizer, SamplingConfig(**graphs_cfg, **cfg))


def test_width_buckets_are_powers_of_two_from_min_width_capped_at_the_columns():
    assert [width_bucket(n, 4352) for n in (1, 64, 65, 257, 4096, 4097, 4352)] == [64, 64, 128, 512, 4096, 4352, 4352]
    assert width_bucket(100, 96) == 96
    assert width_buckets(256, 4352) == [512, 1024, 2048, 4096, 4352]  # prompt 256, budget 4096: 5 widths
    assert width_buckets(0, 4352) == [64, 128, 256, 512, 1024, 2048, 4096, 4352]
    assert width_buckets(10, 64) == [64]


def test_a_bad_key_is_refused(small_model, tokenizer):
    from tidal.config import ConfigError, apply_overrides
    from tidal.system.config import RunConfig
    from tidal.system.validate import validate_run_config

    with pytest.raises(ValueError, match="rollout.graph_widths='half'"):
        _engine(small_model, tokenizer, "half")
    validate_run_config(apply_overrides(RunConfig(), ["rollout.graph_widths=buckets"]))
    with pytest.raises(ConfigError, match=r"^rollout\.graph_widths must be full or buckets, got 'half'$"):
        validate_run_config(apply_overrides(RunConfig(), ["rollout.graph_widths=half"]))


def test_buckets_sample_what_full_and_dynamic_decoding_sample(small_model, tokenizer, narrow):
    """21 rows through 5 slots (rows finish at different lengths and later ones join, so the live span drifts
    right and is moved back), sized up front: every (rows, width) step is built when the cache is sized, none in
    the middle of decoding, and the span is moved left when that narrows the read. Late host reads too."""
    cfg = dict(max_new_tokens=40, max_batch_size=5)
    requests = _requests(tokenizer)
    runs, engines = {}, {}
    for name, widths, extra in (("dynamic", None, {}), ("full", "full", {}), ("buckets", "buckets", {}),
                                ("late", "buckets", dict(host_reads="late", share_identical_rows=False))):
        engine = engines[name] = _engine(small_model, tokenizer, widths, **cfg, **extra)
        if widths == "buckets":
            engine.prepare(requests)  # the slot cache exists: count the moves that narrow the read
            engine._moves = _count_moves(engine._slots)
        runs[name] = engine.generate(requests)
    assert len({t.num_tokens for t in runs["dynamic"]}) > 3, "the test must mix lengths"
    worst = {name: _same_samples(runs[name], runs["dynamic"]) for name in ("full", "buckets", "late")}
    worst["buckets_vs_full"] = _same_samples(runs["buckets"], runs["full"])
    print(f"largest log-prob differences (from the dynamic decode, and buckets from full): {worst}")
    static = engines["buckets"]._slots.static
    widths = {w for _, w in static._steps}
    assert len(widths) >= 3 and max(widths) == engines["buckets"]._slots.columns, widths
    assert static.num_late == 0 and engines["buckets"].stats()["rollout/slot_resizes"] == 0
    assert sum(engines["buckets"]._moves) > 0, "no move narrowed the read: the test does not cover the moves"
    assert engines["late"]._late is not None and engines["late"]._slots.static.num_late == 0


def _count_moves(slots) -> list[bool]:
    """Each of ``slots``' answers to whether moving its span narrows the read (``SlotCache._narrows``)."""
    narrows, moves = slots._narrows, []

    def counted(need: int, end: int) -> bool:
        moves.append(narrows(need, end))
        return moves[-1]

    slots._narrows = counted
    return moves


def _widths_read(monkeypatch, engine) -> list[tuple[int, set[int]]]:
    """(write column, key lengths attention saw) of each static decode step: SDPA's calls counted by a spy."""
    seen: set[int] = set()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        seen.add(key.shape[-2])
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    static, log = engine._slots.static, []
    decode = static.decode

    def logged(tokens_n, pos_n):
        seen.clear()
        out = decode(tokens_n, pos_n)
        log.append((static.slots.t, set(seen)))
        return out

    static.decode = logged
    return log


@pytest.mark.parametrize("widths", ["full", "buckets"])
def test_attention_reads_the_width_bucket_not_the_whole_buffer(small_model, tokenizer, monkeypatch, widths):
    """Sized for a 300-token budget (the cache is 320 columns wide), the first 20 steps of short prompts: with
    ``buckets`` every layer's attention call of a step sees the write column's width bucket (64 columns, the
    default ``MIN_WIDTH``), with ``full`` all 320 columns."""
    requests = _requests(tokenizer, n_prompts=3, group=2)
    engine = _engine(small_model, tokenizer, widths, max_new_tokens=20)
    engine.prepare([dataclasses.replace(r, max_new_tokens=300) for r in requests])
    columns = engine._slots.columns
    assert columns >= 300
    log = _widths_read(monkeypatch, engine)
    engine.generate(requests)
    assert log and all(t < 64 for t, _ in log)
    want = (lambda t: {width_bucket(t + 1, columns)}) if widths == "buckets" else (lambda t: {columns})
    assert all(seen == want(t) for t, seen in log), log[:3]
    if widths == "buckets":
        assert {w for _, seen in log for w in seen} == {64}


def test_speculative_plain_steps_in_width_buckets(peaked, tokenizer, narrow):  # noqa: F811 (a fixture)
    """Speculative decoding's steps without drafts are static steps; rejected drafts are masked in the narrower
    read too, and compaction moves the span left: the samples equal plain decoding's (with and without buckets)."""
    reqs = spec_requests(tokenizer)
    probing = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=0.99, probe_every=3)
    kw = dict(max_new_tokens=21, cuda_graphs="on", graph_widths="buckets")
    plain = LocalEngine(peaked, tokenizer, SamplingConfig(**kw)).generate(reqs)
    engine = LocalEngine(peaked, tokenizer, SamplingConfig(speculative=probing, **kw))
    spec = engine.generate(reqs)
    _same(plain, spec)
    full = LocalEngine(peaked, tokenizer, SamplingConfig(**{**kw, "graph_widths": "full"})).generate(reqs)
    _same(full, plain)
    s = engine._spec
    assert engine._slots.has_rejected or engine._slots.num_compactions > 0
    assert 0 < s.num_verify_steps < s._steps and 0 < s.num_accepted < s.num_drafted


def test_moe_routes_of_width_bucket_steps(moe_model, tokenizer, narrow):  # noqa: F811 (a fixture)
    """An MoE model's routes are written at the device column by the narrower steps too (``write_routes``), and
    moved with the span: each trajectory's routes are the model's own."""
    engine = _engine(moe_model, tokenizer, "buckets", dtype="fp32", max_new_tokens=30, max_batch_size=5)
    trajs = engine.generate(_requests(tokenizer))
    assert len({w for _, w in engine._slots.static._steps}) >= 2
    check_routes(moe_model, trajs)


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_masks_in_width_buckets(tokenizer, narrow, family):
    """Per-layer-type window masks over the narrower read: the same samples as ``full``, and log-probs equal to
    transformers' forward over the whole sequence (rows joining a few at a time)."""
    model, requests = build(family, tokenizer), window_requests(tokenizer)
    runs = {}
    for widths in ("full", "buckets"):
        engine = _engine(model, tokenizer, widths, max_new_tokens=16, max_batch_size=5)
        runs[widths] = _stream(engine, requests, at_a_time=3)
    print(f"{family}: buckets vs full {_same_samples(runs['buckets'], runs['full'])}")
    assert _worst(model, runs["buckets"]) < ATOL


def _long_then_short(tokenizer):
    """Two waves: long prompts first (their widths start at 128), then short ones (64) that join while long rows
    run past column 64, so the 64-wide steps are built (recorded, on CUDA) ahead of use, left of the write column."""
    long = [Prompt(f"l{i}", "12+34=" * 12 + str(i), "") for i in range(3)]
    short = [Prompt(f"s{i}", f"{i}+1=", "") for i in range(4)]
    return group_requests(tokenizer, long, 2), group_requests(tokenizer, short, 2)


def _stream_waves(engine, waves):
    """Each wave asked for once the previous one is running (``stream`` without ``size_for``: each admission sizes
    the slot cache for its own rows, so the second wave's narrower widths are built while the first wave runs)."""
    queue, got = list(waves), {}

    def source(n, block):
        return queue.pop(0) if queue else None

    engine.stream(source, lambda r, t: got.__setitem__((r.prompt.uid, r.sample_index), t))
    return [got[(r.prompt.uid, r.sample_index)] for wave in waves for r in wave]


def test_widths_built_while_rows_run(small_model, tokenizer):
    """A narrower width built while rows run (a shorter prompt joins): the samples equal ``full``'s and dynamic
    decoding's; on CUDA its recording's warm-ups write a live column of the running rows, saved and put back
    (``test_buckets_replay_on_cuda`` replays this)."""
    waves = _long_then_short(tokenizer)
    runs, engines = {}, {}
    for widths in (None, "full", "buckets"):
        engines[widths] = _engine(small_model, tokenizer, widths, max_new_tokens=60, max_batch_size=14)
        runs[widths] = _stream_waves(engines[widths], waves)
    _same_samples(runs["buckets"], runs[None])
    _same_samples(runs["full"], runs[None])
    assert {w for _, w in engines["buckets"]._slots.static._steps} >= {64, 128}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buckets_replay_on_cuda(small_model, tokenizer):
    """Recorded and replayed per (rows, width) bucket: the tokens eager dynamic decoding samples (fp32, log-probs
    within 1e-4), every bucket recorded when the cache is sized, and warm-ups that spared the running rows' live
    columns (a bucket recorded ahead ends left of the write column)."""
    from tests.gpu.test_cuda import report

    requests, waves = _requests(tokenizer), _long_then_short(tokenizer)
    runs, streamed = {}, {}
    for widths in (None, "full", "buckets"):
        cfg = dict(max_new_tokens=100, max_batch_size=5, dtype="fp32")
        cfg = dict(cuda_graphs="off", **cfg) if widths is None else dict(cuda_graphs="auto", graph_widths=widths, **cfg)
        engine = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer, SamplingConfig(**cfg))
        runs[widths] = engine.generate(requests)
        wide = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer,
                           SamplingConfig(**{**cfg, "max_new_tokens": 60, "max_batch_size": 14}))
        streamed[widths] = _stream_waves(wide, waves)
        if widths is not None:
            static = engine._slots.static
            report(f"graph_widths_{widths}", recorded=static.num_recorded, late=static.num_late,
                   failed=static.failed, columns=engine._slots.columns)
            assert not static.failed and static.num_recorded > 0
    for widths in ("full", "buckets"):
        for got, want in ((runs[widths], runs[None]), (streamed[widths], streamed[None])):
            assert [t.token_ids for t in got] == [t.token_ids for t in want]
            for a, b in zip(got, want):
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("mode", ["gqa", "fold"])
def test_grouped_heads_read_the_width_bucket_in_place(tokenizer, narrow, mode):
    """``rollout.decode_attention=gqa|fold`` over the narrower K/V views (4 query heads over 2 KV heads, windowed
    layers): the samples ``repeat`` over the whole width samples."""
    model, requests = build("qwen2", tokenizer), window_requests(tokenizer)
    runs = {}
    for name, widths, attention in (("repeat_full", "full", "repeat"), (mode, "buckets", mode)):
        engine = _engine(model, tokenizer, widths, max_new_tokens=16, max_batch_size=5, decode_attention=attention)
        runs[name] = _stream(engine, requests, at_a_time=3)
    _same_samples(runs[mode], runs["repeat_full"])
