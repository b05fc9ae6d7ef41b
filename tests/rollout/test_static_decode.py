"""Static-shape decode (``rollout/graphs.py``; CUDA graphs on a GPU) against the dynamic slot cache, on the CPU
where the same static step runs eagerly: the same tokens and log-probs through continuous batching, rows
finishing and joining, buffer growth and an in-flight weight update. Replay on CUDA: tests/gpu/test_cuda.py."""

import torch

from tidal.rollout.graphs import bucket
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.slots import SlotCache
from tidal.types import Prompt


def _requests(tokenizer, n_prompts=7, group=3):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def _generate(model, tokenizer, graphs: str, up_front: bool = True, **cfg):
    engine = LocalEngine(model, tokenizer, SamplingConfig(cuda_graphs=graphs, **cfg))
    engine.size_up_front = up_front
    if not up_front:  # the slot cache grows from 8 columns as rows and columns run out (``sizing.py``)
        engine._slots = SlotCache(engine.model, engine.cfg.max_batch_size, min_columns=8)
        if engine._static_decode:
            engine._slots.use_static_decode(engine.model)
    return engine, engine.generate(_requests(tokenizer))


def test_buckets_are_powers_of_two_capped_at_the_slots():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(5, 6) == 6 and bucket(100, 96) == 96


def test_static_decode_samples_what_the_dynamic_decode_samples(small_model, tokenizer):
    # 21 requests through 5 slots: rows finish at different lengths and new ones join into freed slots; not sized
    # up front, 40 tokens outgrow the first buffer width, so the buffers are reallocated (and steps built again).
    cfg = dict(max_new_tokens=40, max_batch_size=5)
    _, dynamic = _generate(small_model, tokenizer, "off", **cfg)
    engine, static = _generate(small_model, tokenizer, "on", up_front=False, **cfg)
    assert engine._static_decode and engine._slots.static is not None and engine._slots.num_growths > 0
    assert [t.token_ids for t in static] == [t.token_ids for t in dynamic]
    for a, b in zip(static, dynamic):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert len({t.num_tokens for t in static}) > 3, "the test must mix lengths"
    again = engine.generate(_requests(tokenizer))  # the engine's slot cache is reused, emptied
    assert [t.token_ids for t in again] == [t.token_ids for t in static]


def test_static_decode_takes_an_inflight_weight_update(small_model, tokenizer):
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in small_model.state_dict().items()}
    runs = {}
    for graphs in ("off", "on"):
        engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12, cuda_graphs=graphs))
        apply, calls = engine._apply_pending_update, []

        def interrupt(engine=engine, apply=apply, calls=calls):
            calls.append(1)
            if len(calls) == 4:
                engine.request_weight_update(new, version=3)
            return apply()

        engine._apply_pending_update = interrupt
        runs[graphs] = engine.generate(_requests(tokenizer))
    assert any(len(set(t.versions)) == 2 for t in runs["on"])
    assert [t.token_ids for t in runs["on"]] == [t.token_ids for t in runs["off"]]
    assert [t.versions for t in runs["on"]] == [t.versions for t in runs["off"]]


def test_a_dropped_engine_frees_its_decode_steps_without_the_garbage_collector(small_model, tokenizer):
    """On CUDA the steps hold recorded graphs; freed by the collector, one could be freed in the middle of
    another engine's recording, which CUDA forbids (seen on an H200). So nothing may hold them in a cycle."""
    import gc
    import weakref

    engine, _ = _generate(small_model, tokenizer, "on", max_new_tokens=6)
    steps = weakref.ref(engine._slots.static)
    gc.disable()
    try:
        del engine
        assert steps() is None, "the static decoder sits in a reference cycle"
    finally:
        gc.enable()


def test_steps_dropped_on_reallocation_are_freed_at_once(small_model, tokenizer):
    """When the buffers grow, the recorded steps are dropped; they must be freed by reference counting then and
    there, not later by the collector (the device check saw a 0.5B engine's recording fail exactly so)."""
    import gc
    import weakref

    engine, _ = _generate(small_model, tokenizer, "on", max_new_tokens=40, max_batch_size=5)
    static = engine._slots.static
    refs = [weakref.ref(step) for step in static._steps.values()]
    assert refs
    gc.disable()
    try:
        static._steps.clear()
        assert all(r() is None for r in refs), "a decode step sits in a reference cycle"
    finally:
        gc.enable()


def test_a_second_stream_at_the_same_time_gets_its_own_slot_cache(small_model, tokenizer):
    """The engine keeps one static slot cache across calls (its graphs are recorded once); a ``stream`` that
    starts while another runs on the same engine must not share it."""
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=6, cuda_graphs="on"))
    first = engine._slot_cache()
    second = engine._slot_cache()
    assert first is engine._slots and second is not first and second.static is None
    engine._slots_in_use = False
    assert engine._slot_cache() is first
