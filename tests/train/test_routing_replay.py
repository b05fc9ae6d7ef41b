"""Routing replay in the trainer (issue 52): the forward uses exactly the replayed experts, in every layout, with
gradients through the recomputed gates; r3 with the trainer's own routes changes nothing; r2 replays the
pre-update routes; agreement and the router losses against hand-computed values."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models import moe, tiny
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig, validate
from tidal.train.packing import pack
from tidal.train.prefix_tree import pack_prefix_trees
from tidal.train.routing import MoeConfig, batch_routes, layout_routes, token_positions
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch

LAYOUTS = {"padded": {}, "packed": {"packing": True, "pack_tokens": 40},
           "tries": {"share_prefixes": True, "pack_tokens": 40},
           "micro": {"micro_batch_tokens": 40, "packing": True, "pack_tokens": 40}}


@pytest.fixture(scope="module")
def moe_model(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, num_experts=4,
                           experts_per_token=2, expert_intermediate_size=64, init_seed=3)
    return tiny.build_model(cfg, tokenizer)


def own_routes(model, ids_bt, attn_bt) -> torch.Tensor:
    """The experts ``model``'s plain padded forward chooses, [B, T, layers, k] (NO_ROUTE on padding)."""
    routing = moe.routing_of(model)
    chosen = {}
    with torch.no_grad(), routing.recording(lambda layer, ids: chosen.__setitem__(layer, ids.clone())):
        model(input_ids=ids_bt, attention_mask=attn_bt)
    routes = torch.stack([chosen[i] for i in range(routing.num_layers)], 1).view(*ids_bt.shape, routing.num_layers, -1)
    return torch.where(attn_bt[..., None, None] > 0, routes.to(torch.uint8), moe.NO_ROUTE)


@pytest.fixture(scope="module")
def batch(moe_model):
    """Two groups of three sharing their prompts (tries share them), long-tailed lengths, the model's own
    log-probs as behaviour and its own routes as the engine's."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (5,), generator=g), torch.randint(3, 40, (7,), generator=g)]
    seqs, groups = [], []
    for gi, p in enumerate(prompts):
        first = torch.randint(3, 40, (2,), generator=g)  # the group's samples share a first response token or two
        for k, n in enumerate((3, 9, 6)):
            seqs.append(torch.cat([p, first[: 1 + k % 2], torch.randint(3, 40, (n,), generator=g)]))
            groups.append(gi)
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = s, 1
        loss[i, len(prompts[groups[i]]) : len(s)] = 1.0
    with torch.no_grad():
        behav = token_logprobs(moe_model, ids, attn)[0] * loss
    versions = torch.where(loss > 0, 0, -1)
    return TrainBatch(ids, attn, loss, behav, versions, torch.tensor(groups), torch.tensor([1.0, 0, 0.5, 0, 1, 1]),
                      routes_btlk=own_routes(moe_model, ids, attn))


def shifted(routes: torch.Tensor, by: int = 1, num_experts: int = 4) -> torch.Tensor:
    """Other experts than ``routes`` everywhere (each id moved by ``by``), padding kept."""
    return torch.where(routes == moe.NO_ROUTE, routes, ((routes.long() + by) % num_experts).to(torch.uint8))


def forward(model, batch, layout: dict, replay: str, rows=None, checkpointing=False):
    """The trainer's log-probs of ``rows`` under ``layout`` and ``replay`` (no update), and the router's gradient
    of their sum."""
    model = copy.deepcopy(model)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig(
        **layout, activation_checkpointing=checkpointing, moe=MoeConfig(routing_replay=replay)))
    rows = torch.arange(batch.num_sequences) if rows is None else rows
    trainer.routes.begin_step(batch, version=0)
    logp, _ = trainer._forward(model, batch, rows)
    (logp * batch.loss_mask_bt[rows]).sum().backward()
    trainer.routes.end_pass()
    router = moe.routing_of(model).routers[0]
    return logp.detach(), router.weight.grad.clone()


def test_token_positions_cover_every_token_and_round_trip(batch):
    lengths = batch.attention_mask_bt.sum(-1).tolist()
    routes = batch.routes_btlk
    for layout in (pack(batch.input_ids_bt, lengths, 40),
                   pack_prefix_trees(batch.input_ids_bt, lengths, batch.group_index_b.tolist(), 40)):
        r, c, b, t = token_positions(layout)
        assert len(b) == sum(lengths)  # every (sequence, position), position 0 included
        assert torch.equal(layout.input_ids_rl[r, c], batch.input_ids_bt[b, t])
        shape = tuple(layout.input_ids_rl.shape)
        laid = layout_routes(routes, layout, shape)
        assert torch.equal(batch_routes(laid, layout, shape, len(lengths), routes.shape[1]), routes)


def test_replay_uses_exactly_the_planned_experts_with_recomputed_gates(moe_model):
    """One MoE block, a plan that differs from the router's own top-k: the output is the planned experts' sum
    weighted by the renormalized softmax of the router's own logits."""
    block = copy.deepcopy(moe_model.model.layers[0].mlp)
    routing = moe.Routing(moe.find_routers(block))
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    own = block.gate(x.view(-1, 64))[2]
    plan = (own + 1) % 4
    assert not torch.equal(plan.sort(-1).values, own.sort(-1).values)
    routing.set_plan(plan[:, None].to(torch.uint8))
    got = block(x).view(-1, 64)
    logits = x.view(-1, 64) @ block.gate.weight.T
    gate = torch.softmax(logits, -1).gather(-1, plan)
    gate = gate / gate.sum(-1, keepdim=True)  # Qwen3-MoE renormalizes (norm_topk_prob=True in the tiny model)
    experts = block.experts
    want = torch.zeros_like(got)
    for n in range(len(plan)):
        for j in range(2):
            e = plan[n, j]
            h_gate, h_up = (x.view(-1, 64)[n] @ experts.gate_up_proj[e].T).chunk(2)
            want[n] += gate[n, j] * (torch.nn.functional.silu(h_gate) * h_up) @ experts.down_proj[e].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0  # the router learns through the recomputed gates
    assert routing.take_agreement()[0] == 0  # no token's own choice matched the plan


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_and_shared_layouts_give_the_padded_log_probs_under_replay(moe_model, batch, layout):
    other = copy.copy(batch)
    other.routes_btlk = shifted(batch.routes_btlk)
    padded, padded_grad = forward(moe_model, other, {}, "r3")
    own, _ = forward(moe_model, other, {}, "off")
    assert (padded - own).abs().max() > 1e-3  # replaying other experts changes the log-probs
    got, grad = forward(moe_model, other, LAYOUTS[layout], "r3")
    scored = batch.attention_mask_bt.clone()
    scored[:, 0] = 0  # padding and position 0 carry no log-prob in a packed layout
    torch.testing.assert_close(got * scored, padded * scored, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, padded_grad, rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_recomputes_with_the_replayed_routes(moe_model, batch):
    other = copy.copy(batch)
    other.routes_btlk = shifted(batch.routes_btlk)
    plain, plain_grad = forward(moe_model, other, {}, "r3")
    again, grad = forward(moe_model, other, {}, "r3", checkpointing=True)
    torch.testing.assert_close(again, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)


def step(model, batch, replay: str, **trainer):
    model = copy.deepcopy(model)
    t = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-2, grad_clip=1e9), TrainerConfig(
        moe=MoeConfig(routing_replay=replay), **trainer))
    metrics = t.step(batch)
    return model, metrics, t


def test_r3_with_the_trainers_own_routes_changes_nothing(moe_model, batch):
    """fp32 engine and trainer choose the same experts: replaying them gives the very update ``off`` gives."""
    off, m_off, _ = step(moe_model, batch, "off")
    r3, m_r3, _ = step(moe_model, batch, "r3")
    for (name, a), b in zip(off.named_parameters(), r3.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert m_off["moe/routing_agreement"] == m_r3["moe/routing_agreement"] == 1.0
    assert m_off["moe/routing_compared"] == batch.attention_mask_bt.sum() * 2  # every token, both layers


def test_agreement_is_the_share_of_matching_token_layer_choices(moe_model, batch):
    other = copy.copy(batch)
    routes = batch.routes_btlk.clone()
    changed = torch.zeros(routes.shape[:3], dtype=torch.bool)
    changed[0, :4, 0] = changed[3, 2:5, 1] = True  # 7 token-layer choices differ from the trainer's own
    routes[changed] = shifted(routes[changed])
    other.routes_btlk = routes
    _, metrics, _ = step(moe_model, other, "off")
    compared = float(batch.attention_mask_bt.sum() * 2)
    assert metrics["moe/routing_agreement"] == pytest.approx((compared - 7) / compared)


def test_agreement_counts_only_sequences_the_current_weights_sampled(moe_model, batch):
    stale = copy.copy(batch)
    stale.versions_bt = batch.versions_bt.clone()
    stale.versions_bt[:2] = torch.where(batch.loss_mask_bt[:2] > 0, 7, -1)  # rows 0, 1: not the trainer's version
    _, metrics, _ = step(moe_model, stale, "off")
    assert metrics["moe/routing_compared"] == batch.attention_mask_bt[2:].sum() * 2


def test_r2_replays_the_routes_the_trainer_chose_before_the_update(moe_model, batch):
    no_engine = copy.copy(batch)
    no_engine.routes_btlk = None
    model, _, trainer = step(moe_model, no_engine, "r2", num_minibatches=2)
    assert torch.equal(trainer.routes.routes_btlk.cpu(), batch.routes_btlk)  # the initial model's own choices
    # one minibatch without a proximal pass: every forward runs before the update; nothing is recorded
    _, _, single = step(moe_model, no_engine, "r2")
    assert single.routes.routes_btlk is None


def test_r3_without_engine_routes_is_a_clear_error(moe_model, batch):
    no_engine = copy.copy(batch)
    no_engine.routes_btlk = None
    with pytest.raises(ConfigError, match="routing_replay=r3 needs the engine's routes"):
        step(moe_model, no_engine, "r3")


def test_router_losses_match_hand_computed_values():
    logits = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])]
    chosen = [torch.tensor([[0], [1]])]
    p = torch.softmax(logits[0], -1)
    f = torch.tensor([0.5, 0.5, 0.0])  # one assignment each to experts 0 and 1
    want = 3 * (f * p.mean(0)).sum()
    assert moe.load_balance_loss(logits, chosen, 3).item() == pytest.approx(want.item())
    uniform = [torch.zeros(4, 3)]
    assert moe.load_balance_loss(uniform, [torch.tensor([[0], [1], [2], [0]])], 3).item() == pytest.approx(1.0)
    z = torch.logsumexp(logits[0], -1) ** 2
    assert moe.router_z_loss(logits).item() == pytest.approx(z.mean().item())
    valid = torch.tensor([True, False])
    assert moe.router_z_loss(logits, valid).item() == pytest.approx(z[0].item())
    assert moe.expert_load(chosen, 3).tolist() == [0.5, 0.5, 0.0]


def test_router_losses_join_the_loss_only_when_on(moe_model, batch):
    _, plain, _ = step(moe_model, batch, "off")
    assert plain["moe/load_balance_loss"] > 0 and plain["moe/z_loss"] > 0 and plain["moe/expert_load_max"] >= 1
    model = copy.deepcopy(moe_model)
    t = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-2, grad_clip=1e9), TrainerConfig(
        moe=MoeConfig(load_balance=True, z_loss=True)))
    on = t.step(batch)
    extra = 0.01 * plain["moe/load_balance_loss"] + 0.001 * plain["moe/z_loss"]
    assert on["train/loss"] == pytest.approx(plain["train/loss"] + extra, rel=1e-5, abs=1e-7)


def test_unreplayed_mismatch_is_logged_beside_the_replayed_one(moe_model, batch):
    other = copy.copy(batch)
    other.routes_btlk = shifted(batch.routes_btlk)
    _, metrics, _ = step(moe_model, other, "r3")
    assert "moe/logp_mismatch_unreplayed_mean" not in metrics  # off by default: it costs a forward
    model = copy.deepcopy(moe_model)
    t = Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig(moe=MoeConfig(routing_replay="r3",
                                                                             mismatch_unreplayed=True)))
    metrics = t.step(other)
    # behaviour = the model's own routes, replay = other experts: replayed scoring is the one that disagrees
    assert metrics["moe/logp_mismatch_unreplayed_mean"] < 1e-5 < metrics["train/logp_mismatch_mean"]


def test_a_bad_replay_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.moe.routing_replay must be one of off, r2, r3"):
        validate(TrainerConfig(moe=MoeConfig(routing_replay="r4")))


def test_dense_models_ignore_the_moe_settings(small_model, batch):
    model = copy.deepcopy(small_model)
    t = Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig(moe=MoeConfig(routing_replay="r3")))
    dense = copy.copy(batch)
    dense.routes_btlk = None
    metrics = t.step(dense)
    assert not any(k.startswith("moe/") for k in metrics)


def test_r2_records_in_the_proximal_pass_without_a_pass_of_its_own(moe_model, batch):
    """With a proximal pass (a correction needs it) and two minibatches: one no-grad pass records the routes and
    gives the proximal log-probs, then one forward per minibatch: three decoder forwards, as ``off`` runs."""
    counts = {}
    for replay in ("off", "r2"):
        model = copy.deepcopy(moe_model)
        forwards = counts.setdefault(replay, [0])
        model.get_decoder().register_forward_hook(lambda *_, n=forwards: n.__setitem__(0, n[0] + 1))
        trainer = Trainer(model, AlgoConfig(correction="tis"), OptimConfig(), TrainerConfig(
            num_minibatches=2, moe=MoeConfig(routing_replay=replay)))
        trainer.step(batch)
        if replay == "r2":
            assert torch.equal(trainer.routes.routes_btlk.cpu(), batch.routes_btlk)
    assert counts == {"off": [3], "r2": [3]}


def test_a_step_with_no_fresh_sequence_logs_no_agreement(moe_model, batch):
    stale = copy.copy(batch)
    stale.versions_bt = torch.where(batch.loss_mask_bt > 0, 7, -1)  # every sequence another version's
    _, metrics, _ = step(moe_model, stale, "off")
    assert "moe/routing_agreement" not in metrics and "moe/routing_compared" not in metrics
