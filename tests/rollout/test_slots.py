"""The slot cache's layout moves (rows leaving, the live span moving back, buffers growing) keep every
sample's log-probs equal to a full forward of its own sequence."""

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
