"""MoE routes recorded by the local engine (``rollout/routes.py``, issue 52), checked against the model itself.

The proof: for the tiny Qwen3-MoE with an fp32 engine, every trajectory's routes equal, token for token and in
order, the experts a plain forward of the same weights over ``prompt_ids + token_ids[:-1]`` chooses (the last
sampled token was never fed: ``NO_ROUTE``), through every way the engine moves a row's columns: continuous
batching with rows finishing and joining (slot moves, buffer growth), shared prefills and decodes, static decode
steps (the CUDA-graph path, run eagerly on the CPU), speculative decoding (rejected drafts dropped, compaction),
an in-flight weight update (re-read under the new weights) and an agent episode resuming a kept turn's KV.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tidal.envs.config import EnvConfig
from tidal.models import moe, tiny
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.routes import merge_turn
from tidal.rollout.slots import SlotCache
from tidal.rollout.speculative import SpeculativeConfig
from tidal.types import Prompt

from .episode_support import Factory, _Recording, generate, prompts_

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)


@pytest.fixture(scope="module")
def moe_model(tokenizer):
    torch.manual_seed(0)
    return tiny.build_model(tiny.ModelConfig(num_experts=8), tokenizer)


@pytest.fixture(scope="module")
def peaked_moe(moe_model):
    """Sharper output distributions (final norm x6), so prompt-lookup drafts are both accepted and rejected
    (``test_speculative.peaked``)."""
    model = copy.deepcopy(moe_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return model


def _requests(tokenizer, n_prompts=5, group=3):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


@torch.no_grad()
def model_routes(model, ids: list[int]) -> torch.Tensor:
    """The experts a plain forward of ``model`` over ``ids`` chooses: uint8 [len(ids), layers, k]."""
    routing = moe.routing_of(model)
    got: dict[int, torch.Tensor] = {}
    with routing.recording(lambda layer, ids_nk: got.__setitem__(layer, ids_nk)):
        model(input_ids=torch.tensor([ids]))
    return torch.stack([got[i] for i in range(routing.num_layers)], 1).to(moe.ROUTE_DTYPE)


def check_routes(model, trajs) -> None:
    """Each trajectory's routes are ``model``'s over prompt + every fed token, and NO_ROUTE for the last."""
    routing = moe.routing_of(model)
    for t in trajs:
        fed = t.prompt_ids + t.token_ids[:-1]
        assert t.routes is not None and t.routes.dtype == moe.ROUTE_DTYPE and t.routes.device.type == "cpu"
        assert t.routes.shape == (len(fed) + 1, routing.num_layers, routing.top_k)
        assert (t.routes[-1] == moe.NO_ROUTE).all()
        want = model_routes(model, fed)
        wrong = (t.routes[:-1] != want).any(-1).any(-1).nonzero().squeeze(1).tolist()
        assert not wrong, f"{t.prompt_uid}/{t.sample_index}: tokens {wrong} of {len(fed)} routed differently"


def _engine(model, tokenizer, **cfg):
    return LocalEngine(model, tokenizer, SamplingConfig(dtype="fp32", **cfg))


def _growing(engine: LocalEngine) -> LocalEngine:
    """``engine`` with a slot cache grown from 8 columns as rows and columns run out, not sized up front
    (``rollout/sizing.py``), so that routes are copied by reallocations while rows run."""
    engine.size_up_front = False
    engine._slots = SlotCache(engine.model, engine.cfg.max_batch_size, min_columns=8)
    if engine._static_decode:
        engine._slots.use_static_decode(engine.model)
    return engine


@pytest.mark.parametrize("share,greedy", [(True, False), (False, False), (True, True)])
def test_routes_are_the_models_own_through_continuous_batching(moe_model, tokenizer, share, greedy):
    # 15 rows through 4 slots: rows finish at different lengths, others join their slots; 30 tokens outgrow
    # the first buffer width (reallocation). Greedy: a group's samples stay identical, decoded once and copied
    engine = _growing(_engine(moe_model, tokenizer, max_new_tokens=30, max_batch_size=4, share_identical_rows=share))
    trajs = engine.generate(_requests(tokenizer), greedy=greedy)
    assert len({t.num_tokens for t in trajs}) > 2 or greedy
    assert engine.num_removed_rows > 0 and engine._slots.num_growths > 0
    check_routes(moe_model, trajs)
    assert (engine.num_shared_decodes > 0) == (share and greedy)


def test_routes_of_static_decode_steps(moe_model, tokenizer):
    """``cuda_graphs=on`` on the CPU runs the static step eagerly: its routes are written at the device column
    ``t_index`` (``graphs._BucketCache.write_routes``), as a recorded graph's replays write them."""
    engine = _growing(_engine(moe_model, tokenizer, max_new_tokens=30, max_batch_size=5, cuda_graphs="on"))
    trajs = engine.generate(_requests(tokenizer))
    assert engine._slots.static is not None and engine._slots.num_growths > 0
    check_routes(moe_model, trajs)


@pytest.mark.parametrize("share", [True, False])
def test_routes_under_speculative_decoding_drop_rejected_drafts(peaked_moe, tokenizer, share):
    engine = _engine(peaked_moe, tokenizer, max_new_tokens=24, max_batch_size=6, speculative=NGRAM,
                     share_identical_rows=share)
    trajs = engine.generate(_requests(tokenizer, n_prompts=4))
    spec = engine._spec
    assert 0 < spec.num_accepted < spec.num_drafted, "drafts must be both accepted and rejected"
    assert engine._slots.num_compactions > 0
    check_routes(peaked_moe, trajs)


def test_draft_model_routes_are_not_recorded(peaked_moe, tokenizer):
    """A draft model is another module, here a copy of the policy with its routers' hooks: its forwards (greedy
    drafts over whole contexts) write nothing; only the engine's own model records routes."""
    moe.routing_of(peaked_moe)
    draft = copy.deepcopy(peaked_moe)  # the copy's hooks point at a Routing of its own
    assert moe.routing_of(draft) is not moe.routing_of(peaked_moe)
    cfg = SpeculativeConfig(method="draft_model", draft_model="unused: passed as a model", num_draft_tokens=3)
    engine = LocalEngine(peaked_moe, tokenizer, SamplingConfig(dtype="fp32", max_new_tokens=16, speculative=cfg),
                         draft_model=draft)
    trajs = engine.generate(_requests(tokenizer, n_prompts=3, group=2))
    assert engine._spec.num_verify_steps > 0
    check_routes(peaked_moe, trajs)


def test_routes_after_an_inflight_weight_update_are_the_new_weights(moe_model, tokenizer):
    """After new weights the engine re-reads every running row: all its routes, earlier tokens' included, are
    then the new model's. Rows that finished before the update keep the old model's."""
    engine = _engine(moe_model, tokenizer, max_new_tokens=16, max_batch_size=6)
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in engine.model.state_dict().items()}
    updated = copy.deepcopy(moe_model)
    updated.load_state_dict(new)
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 6:
            engine.request_weight_update(new, version=7)
        return apply()

    engine._apply_pending_update = interrupt
    reqs = [dataclasses.replace(r, max_new_tokens=2 + 3 * (i % 5)) for i, r in enumerate(_requests(tokenizer))]
    trajs = engine.generate(reqs)
    assert engine.num_interruptions == 1
    old = [t for t in trajs if 7 not in t.versions]
    switched = [t for t in trajs if t.versions[0] == 0 and 7 in t.versions]
    assert old and switched
    check_routes(moe_model, old)
    check_routes(updated, [t for t in trajs if 7 in t.versions])
    t = switched[0]
    assert (model_routes(moe_model, t.prompt_ids) != model_routes(updated, t.prompt_ids)).any(), \
        "the new weights must change some experts, or this test proves nothing"


@pytest.mark.parametrize("reuse", [True, False])
def test_episode_routes_cover_every_turn(moe_model, tokenizer, reuse):
    """An agent episode: each turn's routes (its kept prefix's from the kept turn when ``reuse_turn_kv``) merged
    over the whole context; only the last sampled token, never fed, has none."""
    inner = _engine(moe_model, tokenizer, max_new_tokens=6, reuse_turn_kv=reuse)
    rec = _Recording(inner)
    ee = EpisodeEngine(rec, tokenizer, Factory(turns=3, first="go:"), EnvConfig(), context_len=128, seed=0,
                       max_turn_tokens=6)
    trajs = generate(ee, rec, group_requests(tokenizer, prompts_(3), 2))
    assert (inner.num_reused_tokens > 0) == reuse
    for t in trajs:
        assert t.episode["turns"] == 3
        full = t.prompt_ids + t.token_ids
        assert t.routes.shape[0] == len(full) and (t.routes[-1] == moe.NO_ROUTE).all()
        assert (t.routes[:-1] != moe.NO_ROUTE).all()
        assert torch.equal(t.routes[:-1], model_routes(moe_model, full[:-1]))


def test_merge_turn_keeps_known_routes_and_fills_the_rest():
    none = moe.NO_ROUTE
    known = torch.tensor([[[1]], [[2]], [[none]]], dtype=torch.uint8)  # the last token never fed
    turn = torch.tensor([[[5]], [[6]], [[7]], [[8]], [[none]]], dtype=torch.uint8)
    assert merge_turn(known, turn).flatten().tolist() == [1, 2, 7, 8, none]
    assert merge_turn(None, turn) is turn


def test_a_dense_model_records_no_routes(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=5, speculative=NGRAM))
    trajs = engine.generate(_requests(tokenizer, n_prompts=2, group=2))
    assert all(t.routes is None for t in trajs)
    assert engine._slots.routing is None and engine._slots.routes.numel() == 0

