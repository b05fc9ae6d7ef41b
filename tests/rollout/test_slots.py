"""The slot cache's layout moves (rows leaving, the live span moving back, buffers growing) keep every
sample's log-probs equal to a full forward of its own sequence."""

import pytest
import torch

from tidal.models.logprobs import token_logprobs
from tidal.rollout import slots as slots_module
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


def test_relocation_and_growth_keep_logprobs_exact(small_model, tokenizer, monkeypatch):
    moves, resizes = [], []
    place, resize = slots_module.SlotCache._place, slots_module.SlotCache._resize

    def spy_place(self, min_t, extra):
        before = (self.t, self.columns)
        place(self, min_t, extra)
        if self.n and self.t != before[0] and self.columns == before[1]:
            moves.append(before)  # moved within the same buffer

    def spy_resize(self, slots, columns, dst=None):
        resizes.append((slots, columns))
        return resize(self, slots, columns, dst)

    monkeypatch.setattr(slots_module.SlotCache, "_place", spy_place)
    monkeypatch.setattr(slots_module.SlotCache, "_resize", spy_resize)
    # Short and long prompts joining one or two at a time into a small batch for many steps, so the
    # shared write column runs past the buffer's end (moves) and a long prompt outgrows it (growth).
    texts = [f"{i}+{i}=" for i in range(20)] + ["1234567890" * 5 + "="]
    requests = group_requests(tokenizer, [Prompt(f"p{i}", t, "") for i, t in enumerate(texts)], 2)
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12, max_batch_size=5))
    engine.size_up_front = False  # grown as rows and columns run out (sized up front, nothing would grow)
    queue, got = list(requests), {}

    def source(n, block):
        if not queue:
            return None
        taken, queue[:] = queue[: min(n, 2)], queue[min(n, 2) :]
        return taken

    engine.stream(source, lambda r, t: got.__setitem__((r.prompt.uid, r.sample_index), t))
    assert len(got) == len(requests)
    assert moves, "the live span never moved back in place: the test no longer covers relocation"
    assert len({c for _, c in resizes}) > 2, "the columns never grew past their first size"
    for t in got.values():
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        logp, _ = token_logprobs(small_model, ids, torch.ones_like(ids))
        assert torch.allclose(logp[0, len(t.prompt_ids) :], torch.tensor(t.logprobs), atol=1e-4)


def test_compaction_moves_each_rows_live_columns_in_order(small_model):
    """Rolled-back drafts (rejected columns) are compacted out: each row's live columns, in order, end at one
    shared column as far left as possible, and no column stays marked."""
    cache = slots_module.SlotCache(small_model, max_slots=2, min_columns=8)
    cache._resize(2, 8)
    for buf in (*cache.keys, *cache.values):  # every entry holds its own column index
        buf.copy_(torch.arange(8.0)[None, None, :, None].expand_as(buf))
    cache.n, cache.lo, cache.t = 2, 1, 7
    cache.start[:2] = torch.tensor([1, 4])
    cache.rejected[0, 3:5] = True  # row 0 lives at columns 1, 2, 5, 6
    cache.rejected[1, 5] = True  # row 1 at 4, 6
    cache.has_rejected = True
    cache.last_pos[:2] = torch.tensor([3, 1])  # positions 0..3 and 0..1: 4 and 2 live columns
    cache._place(0, extra=2)  # 7 + 2 columns do not fit in 8: compacted rather than moved or grown
    assert (cache.lo, cache.t, cache.columns, cache.num_compactions) == (0, 4, 8, 1)
    assert cache.start[:2].tolist() == [0, 2]
    for buf in (*cache.keys, *cache.values):
        assert buf[0, 0, 0:4, 0].tolist() == [1.0, 2.0, 5.0, 6.0]
        assert buf[1, 0, 2:4, 0].tolist() == [4.0, 6.0]
    assert not cache.rejected.any() and not cache.has_rejected


def test_buffers_are_kept_across_calls(small_model, tokenizer):
    """Each ``generate`` reuses the engine's slot cache (allocating and zero-filling its buffers on every call took
    10-20% of a call on the CPU), and the samples are those of a fresh engine."""
    requests = group_requests(tokenizer, [Prompt(f"p{i}", f"{i}+{i}=", "") for i in range(6)], 3)
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12))
    first = engine.generate(requests)
    cache, generation = engine._slots, engine._slots.generation
    again = engine.generate(requests[::-1])[::-1]
    assert engine._slots is cache and cache.generation == generation, "the buffers were allocated again"
    fresh = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(requests)
    for a, b, c in zip(first, again, fresh, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(c.logprobs), atol=1e-5)


def test_remove_moves_rows_like_the_per_layer_copies(small_model):
    """``remove`` moves all layers' keys and values with one indexed copy of the stacked buffer; the cache then
    holds what the per-layer copies (one per layer and keys or values) left, and the other slots are untouched."""
    cache = slots_module.SlotCache(small_model, max_slots=6, min_columns=8)
    cache._resize(6, 8)
    torch.manual_seed(0)
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.n, cache.lo, cache.t = 6, 1, 7
    cache.start[:6] = torch.tensor([1, 2, 1, 3, 4, 1])
    cache.start_host[:6] = cache.start[:6]  # its host copy, which finds ``lo`` without a read
    cache.last_pos[:6] = torch.arange(6)
    cache.logits[:6] = torch.randn(6, cache.logits.shape[1])
    keys, values = [k.clone() for k in cache.keys], [v.clone() for v in cache.values]
    start, last_pos, logits = cache.start.clone(), cache.last_pos.clone(), cache.logits.clone()
    keep = torch.tensor([False, True, False, True, True, True])
    holes, movers = cache.remove(keep)
    assert (holes, movers, cache.n, cache.lo) == ([0, 2], [4, 5], 4, 1)
    for buf in (*keys, *values):  # the path before: one copy per layer and per keys or values
        buf[holes, :, 1:7] = buf[movers, :, 1:7]
    for per_row in (start, last_pos, logits):
        per_row[holes] = per_row[movers]
    assert all(torch.equal(a, b) for a, b in zip((*cache.keys, *cache.values), (*keys, *values), strict=True))
    assert torch.equal(cache.start, start) and torch.equal(cache.last_pos, last_pos)
    assert torch.equal(cache.logits, logits)
    assert cache.keys[0].data_ptr() == cache.kv.data_ptr(), "the per-layer buffers are views of the stacked one"


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_nan_left_in_a_freed_slot_reaches_no_later_row(small_model, tokenizer, graphs):
    """Rows join while others run (their spans start further right) and leave, so a slot's masked columns hold
    what earlier rows left there. A masked column weighs 0, but 0 x NaN is NaN: with every buffer column poisoned
    between two calls, the second call's samples must still be a fresh engine's (admission clears a slot)."""
    requests = group_requests(tokenizer, [Prompt(f"p{i}", f"{i * 37}+{i}=", "") for i in range(8)], 2)
    cfg = SamplingConfig(max_new_tokens=10, max_batch_size=3, cuda_graphs=graphs)

    def run(engine):
        queue, got = list(requests), {}

        def source(n, block):
            if not queue:
                return None
            taken, queue[:] = queue[:1], queue[1:]  # one at a time: later rows start right of earlier ones
            return taken

        engine.stream(source, lambda r, t: got.__setitem__((r.prompt.uid, r.sample_index), t))
        return got

    engine = LocalEngine(small_model, tokenizer, cfg)
    run(engine)
    generation = engine._slots.generation
    engine._slots.kv.fill_(float("nan"))
    poisoned = run(engine)
    assert engine._slots.generation == generation, "the buffers were reallocated: the poison never got read"
    fresh = run(LocalEngine(small_model, tokenizer, cfg))
    for key, t in fresh.items():
        assert poisoned[key].token_ids == t.token_ids
        assert torch.allclose(torch.tensor(poisoned[key].logprobs), torch.tensor(t.logprobs), atol=1e-5)
