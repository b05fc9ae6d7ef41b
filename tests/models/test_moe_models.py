"""Mixture-of-experts models wherever tidal runs dense ones (issue 52): LoRA on attention and the fused experts,
merged into an engine copy and by ``tidal export --merge``; checkpoints and ``tiny.save``/``tiny.load``; the
architecture check. fp32 on the CPU, tiny Qwen3-MoE (and tiny Qwen2-MoE, Mixtral, OLMoE where the family matters)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tidal.models import architecture, lora, moe, tiny
from tidal.models.export import export
from tidal.train.checkpoint import TrainingState, latest_checkpoint, load_checkpoint, save_checkpoint

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")


def tiny_moe(tokenizer, **kw) -> torch.nn.Module:
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
                           expert_intermediate_size=16, **kw)
    return tiny.build_model(cfg, tokenizer).eval()


def family(name: str, tokenizer, **extra) -> torch.nn.Module:
    """A tiny random model of an MoE family transformers 5 writes with fused experts and a TopK router."""
    c = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256, num_experts_per_tok=2,
             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
             eos_token_id=tokenizer.eos_token_id, attn_implementation="sdpa")
    config = {"qwen3_moe": lambda: Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, head_dim=8, **c, **extra),
              "qwen2_moe": lambda: Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=16, **c),
              "mixtral": lambda: MixtralConfig(num_local_experts=4, **c),
              "olmoe": lambda: OlmoeConfig(num_experts=4, **c)}[name]()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def perturb(peft_model, seed=0, scale=0.05):
    """Non-zero adapters (B starts at zero: a fresh adapter changes nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def ids(tokenizer):
    return torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))


# ---- architecture ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_check_architecture_accepts_the_moe_families(name, tokenizer):
    model = family(name, tokenizer)
    assert architecture.check_architecture(model).windows == {architecture.FULL: None}
    assert len(moe.find_routers(model)) == 2


# ---- LoRA --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_lora_adapts_attention_and_every_expert_but_no_router(name, tokenizer):
    """PEFT's own all-linear adapts experts and routers on Qwen3-MoE, Mixtral and OLMoE and no expert at all on
    Qwen2-MoE; tidal's is the same on every family: the linear layers and the experts' fused weights."""
    model = family(name, tokenizer)
    wrapped = lora.wrap(copy.deepcopy(model), lora.LoraConfig(rank=2))
    adapted = {n for n, _ in lora._lora_layers(wrapped)}
    experts = set(lora.expert_parameters(model))
    assert experts and experts <= adapted
    attention = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert attention <= adapted
    assert not any(".gate.weight" in n or n.endswith(".mlp.gate") for n in adapted), "a router was adapted"
    if name == "qwen2_moe":  # its shared expert is nn.Linear layers: adapted as dense MLPs are
        assert "model.layers.0.mlp.shared_expert.down_proj" in adapted
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_each_expert_gets_rank_r_adapters(tokenizer):
    wrapped = lora.wrap(tiny_moe(tokenizer), lora.LoraConfig(rank=2))
    layer = dict(lora._lora_layers(wrapped))["model.layers.0.mlp.experts.gate_up_proj"]
    assert layer.num_experts == 4 and layer.r["default"] == 2 and layer.scaling["default"] == 16.0
    assert tuple(layer.lora_A["default"].weight.shape) == (4 * 2, 32)  # [E r, hidden]
    assert tuple(layer.lora_B["default"].weight.shape) == (2 * 16, 4 * 2)  # [2 I, r E]


def test_experts_false_adapts_attention_only(tokenizer):
    wrapped = lora.wrap(tiny_moe(tokenizer), lora.LoraConfig(rank=2, experts=False))
    assert {n.rsplit(".", 1)[-1] for n, _ in lora._lora_layers(wrapped)} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_mlp_names_mean_linear_layers_not_the_experts(tokenizer, ids, tmp_path):
    """A Qwen3-MoE whose layer 0 is a dense MLP (``mlp_only_layers``): PEFT on its own maps ``gate_proj``/``up_proj``/
    ``down_proj`` onto the fused experts and leaves that dense MLP out. tidal's targets mean what they name: the
    dense layer's linear layers; the experts only through ``model.lora.experts``; and the adapters save, resume
    and merge (``tiny.load`` of the checkpoint) the same way."""
    base = family("qwen3_moe", tokenizer, mlp_only_layers=[0])
    assert base.config.model_type == "qwen3_moe"
    linear_only = lora.LoraConfig(rank=2, experts=False, target_modules=["q_proj", "down_proj"])
    wrapped = lora.wrap(copy.deepcopy(base), linear_only)
    assert base.config.model_type == "qwen3_moe"  # the PEFT mapping was kept out for the wrap only
    assert {n for n, _ in lora._lora_layers(wrapped)} == {
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    full = lora.wrap(copy.deepcopy(base), lora.LoraConfig(rank=2))
    adapted = {n for n, _ in lora._lora_layers(full)}
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.1.mlp.experts.gate_up_proj"} <= adapted
    perturb(full)
    tiny.save(base, tokenizer, tmp_path / "base")
    full.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    opt = torch.optim.AdamW(lora.trainable_parameters(full), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path / "ckpts", full, tokenizer, opt, sched, TrainingState(1, 1, 0, {}))
    merged, _ = tiny.load(ckpt)
    torch.testing.assert_close(logits(merged.eval(), ids), logits(full.eval(), ids), rtol=0, atol=1e-5)
    resumed = lora.wrap(copy.deepcopy(base), lora.LoraConfig(rank=2))
    opt2 = torch.optim.AdamW(lora.trainable_parameters(resumed), lr=1e-3)
    load_checkpoint(ckpt, resumed, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0))
    torch.testing.assert_close(logits(resumed.eval(), ids), logits(full, ids), rtol=0, atol=0)


def test_lora_delta_is_peft_s_delta(tokenizer):
    """``lora_delta`` (what the engine computes from an update) against PEFT's own ``get_delta_weight``."""
    wrapped = lora.wrap(tiny_moe(tokenizer), lora.LoraConfig(rank=2))
    perturb(wrapped)
    for name, layer in lora._lora_layers(wrapped):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        shape = (layer.get_param() if lora._is_param(layer) else layer.base_layer.weight).shape
        torch.testing.assert_close(lora.lora_delta(a, b, layer.scaling["default"], shape),
                                   layer.get_delta_weight("default"), rtol=0, atol=1e-6, msg=name)


def test_engine_copy_after_an_update_computes_the_peft_model(tokenizer, ids):
    """The engine's merged copy, then an adapter update applied in place (``apply_update``, as
    ``LocalEngine._apply_pending_update`` does), against the PEFT model's own forward: fp32, the same logits."""
    wrapped = lora.wrap(tiny_moe(tokenizer), lora.LoraConfig(rank=2)).eval()
    perturb(wrapped, seed=0)
    engine, base = lora.engine_copy(wrapped)
    assert not lora.is_peft(engine) and type(engine).__name__ == "Qwen3MoeForCausalLM"
    assert "model.layers.1.mlp.experts.down_proj" in base
    torch.testing.assert_close(logits(engine, ids), logits(wrapped, ids), rtol=0, atol=1e-5)
    before = logits(engine, ids)
    perturb(wrapped, seed=1)
    update = lora.adapter_update(wrapped)
    assert update["model.layers.0.mlp.experts.gate_up_proj.lora_A"].shape == (4 * 2, 32)
    lora.apply_update(engine, base, update)
    torch.testing.assert_close(logits(engine, ids), logits(wrapped, ids), rtol=0, atol=1e-5)
    assert (logits(engine, ids) - before).abs().max() > 1e-2, "the update changed nothing: the test proves nothing"
    with wrapped.disable_adapter():  # the experts' adapters matter: without them the logits move
        assert (logits(wrapped, ids) - logits(engine, ids)).abs().max() > 1e-2
    assert moe.routing_of(engine) is not None and len(moe.routing_of(engine).routers) == 2


def test_export_merge_of_an_moe_lora_checkpoint(tokenizer, ids, tmp_path):
    """``tidal export --merge`` of an MoE LoRA run: a plain Qwen3-MoE directory whose forward is the PEFT model's;
    the checkpoint itself loads (``tiny.load``) as the base with the adapters merged."""
    base = tiny_moe(tokenizer)
    tiny.save(base, tokenizer, tmp_path / "base")
    wrapped = lora.wrap(copy.deepcopy(base), lora.LoraConfig(rank=2), base_path=tmp_path / "base").eval()
    perturb(wrapped)
    opt = torch.optim.AdamW(lora.trainable_parameters(wrapped), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path / "ckpts", wrapped, tokenizer, opt, sched, TrainingState(3, 3, 0, {}))
    info = export(ckpt, tmp_path / "merged", merge=True)
    assert info["kind"] == "merged"
    merged, _ = tiny.load(tmp_path / "merged")
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    torch.testing.assert_close(logits(merged.eval(), ids), logits(wrapped, ids), rtol=0, atol=1e-5)
    from_ckpt, _ = tiny.load(ckpt)
    torch.testing.assert_close(logits(from_ckpt.eval(), ids), logits(wrapped, ids), rtol=0, atol=1e-5)


# ---- checkpoints and tiny.save / tiny.load -----------------------------------------------------------------
def test_tiny_save_and_load_round_trip_an_moe(tokenizer, ids, tmp_path):
    model = tiny_moe(tokenizer)
    tiny.save(model, tokenizer, tmp_path / "m")
    loaded, tok = tiny.load(tmp_path / "m")
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM" and loaded.config.num_experts == 4
    assert loaded.config.num_experts_per_tok == 2 and tok.get_vocab() == tokenizer.get_vocab()
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(logits(loaded.eval(), ids), logits(model, ids))


def _train(model, opt, sched, ids, steps):
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("rank", [0, 2])
def test_checkpoint_resume_of_an_moe_is_exact(tokenizer, ids, tmp_path, rank):
    """Train 2 steps, save, train 1 more; a fresh model resumed from the checkpoint then trains the same step to
    the same bits (weights, AdamW moments, schedule), whole model or LoRA on attention and experts."""
    def fresh():
        model = tiny_moe(tokenizer).train()
        if rank:
            model = lora.wrap(model, lora.LoraConfig(rank=rank))
        opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

    torch.manual_seed(0)
    model, opt, sched = fresh()
    if rank:
        perturb(model)
    _train(model, opt, sched, ids, 2)
    save_checkpoint(tmp_path, model, tokenizer, opt, sched, TrainingState(2, 2, 0, {}))
    _train(model, opt, sched, ids, 1)

    resumed, opt2, sched2 = fresh()
    state = load_checkpoint(latest_checkpoint(tmp_path), resumed, opt2, sched2)
    assert state.step == 2
    _train(resumed, opt2, sched2, ids, 1)
    want, got = dict(model.named_parameters()), dict(resumed.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert any("experts" in n for n, p in got.items() if p.requires_grad)


def test_the_trainer_trains_expert_adapters_with_and_without_activation_checkpointing(tokenizer):
    """Two RL steps of tidal's trainer on LoRA over attention and experts: the expert adapters move, and
    activation checkpointing's recompute (PEFT re-applies each expert's delta inside it) changes no bit."""
    from tests.parallel.test_fsdp import make_batch
    from tidal.algo.config import AlgoConfig
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer

    def run(checkpointing: bool):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = lora.wrap(tiny_moe(tokenizer).train(), lora.LoraConfig(rank=2))
        trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=3e-2),
                          TrainerConfig(activation_checkpointing=checkpointing))
        losses = [trainer.step(make_batch(seed))["train/loss"] for seed in range(2)]
        return losses, trainer.state_dict_for_engine()

    (losses, plain), (losses_ac, recomputed) = run(False), run(True)
    assert losses == losses_ac
    assert plain.keys() == recomputed.keys() and all(torch.equal(plain[k], recomputed[k]) for k in plain)
    b = plain["model.layers.0.mlp.experts.down_proj.lora_B"]
    assert b.abs().max() > 0, "the experts' B started at zero and should have moved"


def test_the_local_engine_samples_with_the_trainers_expert_adapters_after_a_sync(tokenizer):
    """Through ``LocalEngine``: a trainer step on LoRA over attention and experts, the adapters sent, and the
    engine's behaviour log-probs of what it samples next are the trainer's own (fp32), tagged with its version."""
    from tidal.algo.config import AlgoConfig
    from tidal.optim import OptimConfig
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.rollout.requests import group_requests
    from tidal.train.batch import build_train_batch
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer
    from tidal.types import Group, Prompt

    policy = lora.wrap(tiny_moe(tokenizer).train(), lora.LoraConfig(rank=2))
    engine = LocalEngine(policy, tokenizer, SamplingConfig(max_new_tokens=6))
    trainer = Trainer(policy, AlgoConfig(), OptimConfig(lr=5e-2), TrainerConfig())

    def batch(rewards):
        prompts = [Prompt(f"p{i}", f"{i}+{2 * i}=", str(3 * i)) for i in range(len(rewards))]
        n = len(rewards[0])
        trajs = engine.generate(group_requests(tokenizer, prompts, n))
        groups = [Group(p, trajs[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]
        for g, rs in zip(groups, rewards):
            for t, r in zip(g.trajectories, rs):
                t.reward = r
        return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]

    trainer.step(batch([[1.0, 0.0, 0.0, 0.0]] * 4))
    update = trainer.state_dict_for_engine()
    assert lora.is_adapter_update(update) and "model.layers.1.mlp.experts.gate_up_proj.lora_B" in update
    engine.request_weight_update(update, trainer.version)
    b = batch([[1.0, 0.0, 0.0, 1.0]] * 3)
    mask = b.loss_mask_bt.bool()
    assert (b.versions_bt[mask] == 1).all()
    torch.testing.assert_close(trainer._scores(trainer.model, b)[mask], b.behav_logp_bt[mask], atol=2e-5, rtol=0)
