"""``rollout.host_reads=late`` (``rollout/late_reads.py``, issue 51) against the synchronous reads, on the CPU where
the late path runs as it does on a GPU (its copies plain, no event): the same trajectories (tokens, log-probs,
versions, finish reasons, loss masks, MoE routes, kept episode turns) through temperature and greedy sampling, EOS,
stop strings, per-request length budgets, early truncation, continuous batching (more rows than slots), in-flight
weight updates, static decode (the CUDA-graph step, run eagerly) and agent episodes; the cases that need the tokens
on the host first fall back to synchronous reads and say so; a late step reads nothing from the device but its
pinned buffer, and the slot cache's host copy of the rows' starts stays the device's."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tidal.envs.config import EnvConfig
from tidal.rollout import late_reads as late_module
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.slots import SlotCache
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

from .episode_support import Factory, _Recording, generate, prompts_
from .test_engine_routes import check_routes, model_routes, moe_model  # noqa: F401 (a fixture)


def _requests(tokenizer, n_prompts=6, group=3, budgets=(3, 12, 7, None), first=0):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(first, first + n_prompts)]
    reqs = group_requests(tokenizer, prompts, group)
    return [dataclasses.replace(r, max_new_tokens=budgets[i % len(budgets)]) for i, r in enumerate(reqs)]


def _engine(model, tokenizer, reads: str, **cfg) -> LocalEngine:
    cfg = {"max_new_tokens": 10, "share_identical_rows": False, **cfg}
    return LocalEngine(model, tokenizer, SamplingConfig(host_reads=reads, **cfg))


def _both(model, tokenizer, requests, greedy=False, setup=None, **cfg):
    """(sync engine, its trajectories, late engine, its trajectories) for the same requests and settings."""
    out = []
    for reads in ("sync", "late"):
        engine = _engine(model, tokenizer, reads, **cfg)
        if setup is not None:
            setup(engine)
        out += [engine, engine.generate(requests, greedy=greedy)]
    return out


def assert_same(late, sync) -> None:
    for a, b in zip(late, sync, strict=True):
        assert a.token_ids == b.token_ids, (a.prompt_uid, a.sample_index)
        # a finished row stays in the batch one more step, so a step's batch and live span can differ and sums run
        # in another order: equal up to float32 rounding (about 1e-7 measured), not bit for bit
        assert len(a.logprobs) == len(b.logprobs) and all(abs(x - y) < 1e-5 for x, y in zip(a.logprobs, b.logprobs))
        assert (a.versions, a.finish_reason, a.loss_mask) == (b.versions, b.finish_reason, b.loss_mask)
        assert (a.routes is None) == (b.routes is None)
        if a.routes is not None:
            assert torch.equal(a.routes, b.routes)


@pytest.mark.parametrize("greedy,graphs", [(False, "off"), (True, "off"), (False, "on")])
def test_late_reads_give_the_synchronous_trajectories(small_model, tokenizer, greedy, graphs):
    # 18 requests through 5 slots: rows finish by EOS, by their own length budgets (3, 7, 12) or the engine's (10),
    # others join the freed slots while the rest run; static decode reads the whole buffer width
    reqs = _requests(tokenizer)
    sync_engine, sync, late_engine, late = _both(small_model, tokenizer, reqs, greedy, max_batch_size=5,
                                                 cuda_graphs=graphs)
    assert_same(late, sync)
    assert late_engine._late is not None and late_engine._late.num_steps >= late_engine.num_decode_steps > 0
    assert sync_engine._late is None and "rollout/late_steps" not in sync_engine.stats()
    assert late_engine.num_generated_tokens == sync_engine.num_generated_tokens == sum(t.num_tokens for t in late)
    assert late_engine.stats()["rollout/late_steps"] == late_engine._late.num_steps
    reasons = {t.finish_reason for t in late}
    assert "length" in reasons and (greedy or "stop" in reasons)
    if not greedy:
        assert len({t.num_tokens for t in late}) > 3, "the test must mix lengths"
    # a finished row is found one step late: each costs at most one more step than the synchronous path
    assert sync_engine.num_decode_steps <= late_engine.num_decode_steps <= sync_engine.num_decode_steps + len(reqs)


def test_stop_strings_and_early_truncation(small_model, tokenizer):
    free = _engine(small_model, tokenizer, "sync", max_new_tokens=20).generate(_requests(tokenizer, budgets=(None,)))
    char = next(c for t in free for c in t.text if c.strip())
    probs = sorted(p for t in free for p in torch.tensor(t.logprobs).exp().tolist())
    median = probs[len(probs) // 2]  # the untrained model is near uniform: a run of 3 above the median is common
    cfg = dict(max_new_tokens=20, stop=[char], early_stop_run=3, early_stop_prob=median, max_batch_size=7)
    _, sync, late_engine, late = _both(small_model, tokenizer, _requests(tokenizer, budgets=(None,)), **cfg)
    assert_same(late, sync)
    assert {"stop", "repetition"} <= {t.finish_reason for t in late}
    assert any(t.text.endswith(char) for t in late)


def test_inflight_weight_updates(small_model, tokenizer):
    """New weights land between two steps: the pending step is read first, so every token keeps the version it was
    sampled under, and the rows are re-read with all their tokens. Every row runs from the start (no admission
    waits on a slot), so both paths see the update at the same token of every row."""
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in small_model.state_dict().items()}

    def setup(engine):
        apply, calls = engine._apply_pending_update, []

        def interrupt():
            calls.append(1)
            if len(calls) in (4, 7):
                engine.request_weight_update(new if len(calls) == 4 else engine.model.state_dict(), len(calls))
            return apply()

        engine._apply_pending_update = interrupt

    reqs = _requests(tokenizer, budgets=(12, 6, None))
    sync_engine, sync, late_engine, late = _both(small_model, tokenizer, reqs, setup=setup, max_new_tokens=14)
    assert_same(late, sync)
    assert sync_engine.num_interruptions == late_engine.num_interruptions == 2
    assert any(t.versions[0] == 0 and 7 in t.versions for t in late)


def test_interruptions_through_continuous_batching(small_model, tokenizer):
    """Updates with unchanged weights while rows finish and join: no token or log-prob moves (the schedule differs
    by a step from the synchronous one, and the noise does not depend on it)."""
    def setup(engine):
        apply, calls = engine._apply_pending_update, []

        def interrupt():
            calls.append(1)
            if len(calls) % 5 == 0:
                engine.request_weight_update({k: v.clone() for k, v in engine.model.state_dict().items()}, 0)
            return apply()

        engine._apply_pending_update = interrupt

    sync_engine, sync, late_engine, late = _both(small_model, tokenizer, _requests(tokenizer), setup=setup,
                                                 max_batch_size=4)
    assert late_engine.num_interruptions > 1 and sync_engine.num_interruptions > 1
    for a, b in zip(late, sync, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4  # re-read at other steps


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_moe_routes_leave_out_the_column_fed_late(moe_model, tokenizer, graphs):  # noqa: F811
    """A row found finished one step late had its last token fed; its routes are still those of prompt + every
    token but the last (the model's own), as the synchronous path records them."""
    cfg = dict(dtype="fp32", max_new_tokens=14, max_batch_size=4, cuda_graphs=graphs)
    _, sync, late_engine, late = _both(moe_model, tokenizer, _requests(tokenizer, 4, 3, budgets=(14, 5)), **cfg)
    assert_same(late, sync)
    assert late_engine._late.num_steps > 0 and late_engine.num_removed_rows > 0
    check_routes(moe_model, late)


def test_episode_turns_kept_without_the_column_fed_late(moe_model, tokenizer):  # noqa: F811
    """An agent episode's finished turn is kept (``reuse_turn_kv``) without the column its last token was fed at:
    the next turn resumes from the same keys, with the same routes, as with synchronous reads."""
    runs = {}
    for reads in ("sync", "late"):
        inner = _engine(moe_model, tokenizer, reads, dtype="fp32", max_new_tokens=6)
        rec = _Recording(inner)
        ee = EpisodeEngine(rec, tokenizer, Factory(turns=3, first="go:"), EnvConfig(), context_len=128, seed=0,
                           max_turn_tokens=6)
        runs[reads] = (inner, generate(ee, rec, group_requests(tokenizer, prompts_(3), 2)))
    inner, late = runs["late"]
    assert inner._late.num_steps > 0 and inner.num_reused_tokens == runs["sync"][0].num_reused_tokens > 0
    assert_same(late, runs["sync"][1])
    for t in late:  # every turn's routes, the kept prefixes' included, are the model's own
        full = t.prompt_ids + t.token_ids
        assert torch.equal(t.routes[:-1], model_routes(moe_model, full[:-1]))


def test_a_call_inside_another_has_its_own_pending_step(small_model, tokenizer):
    """Two ``stream`` calls on one engine at once (here one started from the other's ``on_done``) each read their
    own pending step through their own buffers, as each decodes in its own slot cache."""
    outer, inner = _requests(tokenizer, 3, 2), _requests(tokenizer, 3, 2, first=20)
    sync = _engine(small_model, tokenizer, "sync")
    want_outer, want_inner = sync.generate(outer), sync.generate(inner)
    engine = _engine(small_model, tokenizer, "late")
    got, nested = {}, []

    def on_done(req, traj):
        got[(req.prompt.uid, req.sample_index)] = traj
        if not nested:
            nested.append(engine.generate(inner))

    queue = [outer]
    engine.stream(lambda n, block: queue.pop() if queue else None, on_done)
    assert_same([got[(r.prompt.uid, r.sample_index)] for r in outer], want_outer)
    assert_same(nested[0], want_inner)
    assert len(engine._late._free) == 2, "each call's buffers are given back"


def test_the_cases_that_need_tokens_on_the_host_read_synchronously(small_model, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger=late_module.__name__):
        shared = _engine(small_model, tokenizer, "late", share_identical_rows=True)
        spec = _engine(small_model, tokenizer, "late", speculative=SpeculativeConfig(method="ngram"))
    assert shared._late is None and spec._late is None
    assert "share_identical_rows" in caplog.text and "speculative" in caplog.text
    assert _engine(small_model, tokenizer, "late", share_identical_rows=True, cuda_graphs="on")._late is not None
    with pytest.raises(ValueError, match="host_reads"):
        _engine(small_model, tokenizer, "later")


def test_budget_forcing_switches_the_call_to_synchronous_reads(small_model, tokenizer, caplog):
    """Rows with a thinking budget join after late steps ran: the pending step is read, the rest of the call is
    synchronous (forcing rewrites tokens before they are fed), and the trajectories are the synchronous path's."""
    close = tuple(tokenizer("9=", add_special_tokens=False).input_ids)
    plain = _requests(tokenizer, n_prompts=2, budgets=(8,))
    budgeted = [dataclasses.replace(r, thinking_budget=2, thinking_close=close)
                for r in _requests(tokenizer, 2, first=10)]
    runs = {}
    for reads in ("sync", "late"):
        engine = _engine(small_model, tokenizer, reads)
        queue, got = [plain, budgeted], {}

        def source(n, block, queue=queue):
            return queue.pop(0) if queue else None

        with caplog.at_level(logging.INFO, logger=late_module.__name__):
            engine.stream(source, lambda req, traj, got=got: got.__setitem__((req.prompt.uid, req.sample_index),
                                                                              traj))
        runs[reads] = (engine, [got[k] for k in sorted(got)])
    assert_same(runs["late"][1], runs["sync"][1])
    assert any(t.loss_mask and 0 in t.loss_mask for t in runs["late"][1]), "some close must be forced"
    assert 0 < runs["late"][0]._late.num_steps < runs["late"][0].num_decode_steps
    assert "thinking budget" in caplog.text


def _reads_in_steady_steps(model, tokenizer, reads: str, monkeypatch) -> list[str]:
    """The reads of a tensor (other than the late step's own host buffers) and the ``torch.tensor`` uploads made
    inside the first 8 decode steps of a run where no row finishes before its 12th token."""
    engine = _engine(model, tokenizer, reads, cuda_graphs="on", max_new_tokens=12)
    engine.end_ids = set()  # no EOS: every row runs its whole budget, so the steps before the last are steady
    seen, counting, ptrs = [], [False], set()

    def counting_step(step):
        def counted(*args):
            if len(args) == 5:  # a LateCall's step: its host buffers are what it may read
                ptrs.update(b.untyped_storage().data_ptr() for bufs in args[0].buffers for b in bufs[:2])
            counting[0] = engine.num_decode_steps < 8
            try:
                return step(*args)
            finally:
                counting[0] = False
        return counted

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def wrapped(t, *a, **kw):
            if counting[0] and t.untyped_storage().data_ptr() not in ptrs:
                seen.append(name)
            return original(t, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        wrap(name)
    tensor = torch.tensor

    def upload(*a, **kw):
        if counting[0]:
            seen.append("torch.tensor")
        return tensor(*a, **kw)

    monkeypatch.setattr(torch, "tensor", upload)
    if engine._late is not None:
        monkeypatch.setattr(late_module.LateCall, "step", counting_step(late_module.LateCall.step))
    else:
        monkeypatch.setattr(engine, "_sample_step", counting_step(engine._sample_step))
    try:
        engine.generate(_requests(tokenizer, 2, 3, budgets=(12,)))
    finally:
        monkeypatch.undo()
    return seen


def test_a_late_step_reads_only_its_pinned_buffer(small_model, tokenizer, monkeypatch):
    """While no row finishes, a late step makes no read of a device tensor and no upload: its only read is the
    previous step's tokens from its own host buffer (on CUDA after that step's event). The synchronous step reads
    its tokens back and uploads keys and positions every step. (On a GPU: ``test_no_sync_in_late_steps``.)"""
    assert _reads_in_steady_steps(small_model, tokenizer, "late", monkeypatch) == []
    sync = _reads_in_steady_steps(small_model, tokenizer, "sync", monkeypatch)
    assert sync.count("tolist") >= 2 * 7 and sync.count("torch.tensor") >= 2 * 7


def test_the_host_copy_of_row_starts_stays_the_devices(small_model, tokenizer, monkeypatch):
    """``SlotCache.start_host`` (which finds ``lo`` without a read) equals ``start`` at every step through
    admissions, removals, span moves, reallocation and speculative compaction."""
    checked = [0]
    decode, run = SlotCache.decode, SlotCache.run

    def check(slots):
        assert torch.equal(slots.start_host[: slots.n], slots.start[: slots.n].cpu())
        assert slots.lo == (int(slots.start[: slots.n].min()) if slots.n else slots.lo)
        checked[0] += 1

    monkeypatch.setattr(SlotCache, "decode", lambda self, *a, **k: (check(self), decode(self, *a, **k))[1])
    monkeypatch.setattr(SlotCache, "run", lambda self, *a, **k: (check(self), run(self, *a, **k))[1])
    for cfg in (dict(host_reads="late", share_identical_rows=False), dict(speculative=SpeculativeConfig(
            method="ngram", num_draft_tokens=3, ngram_min=1))):
        engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=30, max_batch_size=4, **cfg))
        engine.size_up_front = False
        engine._slots = SlotCache(engine.model, 4, min_columns=8)
        engine.generate(_requests(tokenizer, budgets=(30, 4, 17)))
        assert engine._slots.num_growths > 0 and engine.num_removed_rows > 0
    assert checked[0] > 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_in_late_steps(small_model, tokenizer, monkeypatch):
    """On CUDA (bf16, CUDA graphs), steady late steps (no row finishing) run under
    ``torch.cuda.set_sync_debug_mode('error')``: no read and no upload in them waits for the device (waiting on the
    previous step's event is not a stream synchronization), and the tokens are the synchronous path's."""
    import copy

    requests = _requests(tokenizer, 2, 3, budgets=(12,))
    runs = {}
    for reads in ("sync", "late"):
        engine = _engine(copy.deepcopy(small_model).cuda(), tokenizer, reads, max_new_tokens=12)
        engine.end_ids = set()  # every row runs its 12 tokens: no row finishes before the last steps
        engine.generate(requests)  # warm-up: graphs recorded, the sampler compiled
        if reads == "late":
            first, step = engine.num_decode_steps, late_module.LateCall.step

            def strict(*args, engine=engine, first=first, step=step):
                if engine.num_decode_steps - first < 8:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    return step(*args)
                finally:
                    torch.cuda.set_sync_debug_mode(0)

            monkeypatch.setattr(late_module.LateCall, "step", strict)
        runs[reads] = [t.token_ids for t in engine.generate(requests)]
    assert runs["late"] == runs["sync"]


def test_the_bench_arm_runs_both_reads_on_a_toy_size(tmp_path):
    """``tidal bench gpu``'s ``host_reads`` part (``benchmarks/_gpu_engine.py``; the device check's ``arms`` stage):
    both arms decode the same rows to the same tokens, the late one through late steps."""
    from tidal import bench

    result = bench.load("gpu").run(["device=cpu", "tiny=true", "parts=[host_reads]"], tmp_path / "gpu")
    arms = result["host_reads"]
    assert "error" not in arms, arms
    assert result["host_reads_same_tokens"] is True and arms["late"]["late_steps"] > 0 == arms["sync"]["late_steps"]
    assert set(result["decode_step_ms_by_host_reads"]) == {"sync", "late"}
    assert [r["part"] for r in result["table"]].count("host_reads") == 2
