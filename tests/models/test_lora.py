"""LoRA pieces (models/lora.py) against hand-computed references: the merge W0 + (alpha / r) B A, the
adapters-off reference, the optimizer's contents, and the engine fed adapter updates."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models import lora
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")


def _lora(model, rank=4, **kw):
    return lora.wrap(copy.deepcopy(model), lora.LoraConfig(rank=rank, **kw))


def _perturb(peft_model, seed=0):
    """Non-zero adapters (B starts at zero, so a fresh adapter is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _batch(engine, tokenizer, rewards):
    prompts = [Prompt(f"p{i}", f"{i}+{2 * i}=", str(3 * i)) for i in range(len(rewards))]
    n = len(rewards[0])
    trajs = engine.generate(group_requests(tokenizer, prompts, n))
    groups = [Group(p, trajs[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]
    for g, rs in zip(groups, rewards):
        for t, r in zip(g.trajectories, rs):
            t.reward = r
    return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]


def test_defaults_follow_lora_without_regret_and_are_off():
    cfg = lora.LoraConfig()
    assert not cfg.enabled and cfg.alpha == 32.0 and cfg.dropout == 0.0 and cfg.target_modules == ["all-linear"]


def test_all_linear_adapts_attention_and_mlp_not_the_head(small_model):
    names = {n.rsplit(".", 1)[-1] for n, _ in lora._lora_layers(_lora(small_model))}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rank", -1, "model.lora.rank"), ("alpha", 0.0, "model.lora.alpha"), ("dropout", 1.0, "model.lora.dropout"),
    ("target_modules", [], "model.lora.target_modules"), ("target_modules", ["all-linear", "q_proj"], "alone"),
    ("init", "pissa", "model.lora.init"), ("quantize", "8bit", "model.lora.quantize"),
    ("experts", "yes", "model.lora.experts"),
])
def test_bad_values_are_one_line_naming_the_key(field, value, message):
    cfg = lora.LoraConfig(rank=4)
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=message) as e:
        lora.validate(cfg)
    assert "\n" not in str(e.value)


def test_qlora_on_cpu_is_one_clear_line():
    with pytest.raises(ConfigError, match=r"model\.lora\.quantize=4bit \(QLoRA\) needs a CUDA device"):
        lora.check_device(lora.LoraConfig(rank=4, quantize="4bit"), torch.device("cpu"))


def test_unmatched_target_modules_name_the_key(small_model):
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules=\['nope'\]"):
        _lora(small_model, target_modules=["nope"])


def test_merge_is_w0_plus_alpha_over_r_times_b_a(small_model):
    """The engine's merged weight, checked against the formula by hand for one layer (alpha 32, r 4: s = 8)."""
    pm = _lora(small_model)
    _perturb(pm)
    plain, base = lora.engine_copy(pm)
    layer = dict(pm.named_modules())["base_model.model.model.layers.0.mlp.down_proj"]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w0 = small_model.model.layers[0].mlp.down_proj.weight
    want = w0 + 8.0 * (b @ a)
    torch.testing.assert_close(dict(plain.named_modules())["model.layers.0.mlp.down_proj"].weight, want,
                               atol=1e-6, rtol=0)
    assert torch.equal(base["model.layers.0.mlp.down_proj"], w0)
    from peft.tuners.lora import LoraLayer

    assert not any(isinstance(m, LoraLayer) for m in plain.modules()) and not lora.is_peft(plain)
    want_all = copy.deepcopy(pm).merge_and_unload().state_dict()  # peft's own merge, all layers
    got_all = plain.state_dict()
    assert got_all.keys() == want_all.keys()
    for k in want_all:
        torch.testing.assert_close(got_all[k], want_all[k], atol=1e-6, rtol=0)


def test_adapters_off_reference_equals_the_frozen_base_exactly(small_model, tokenizer):
    """With algo.kl_coef > 0 the LoRA trainer scores the reference as the policy with adapters disabled: the
    same numbers, bit for bit, as the base model itself, after the adapters have moved."""
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=5))
    batch = _batch(engine, tokenizer, [[1.0, 0.0, 0.0, 1.0]] * 3)
    algo = AlgoConfig(kl_coef=0.1)
    trainer = Trainer(_lora(small_model), algo, OptimConfig(lr=1e-2), TrainerConfig())
    assert trainer.ref_model is None  # no second copy of the base
    trainer.step(batch)
    base = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig())
    want = base._scores(base.model, batch)
    assert torch.equal(trainer._reference_scores(batch), want)
    assert not torch.equal(trainer._scores(trainer.model, batch), want), "the adapters must have moved"


def test_optimizer_holds_only_the_adapters(small_model, tokenizer):
    pm = _lora(small_model)
    trainer = Trainer(pm, AlgoConfig(), OptimConfig(), TrainerConfig())
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    by_id = {id(p): n for n, p in pm.named_parameters()}
    assert held and all("lora_A" in by_id[i] or "lora_B" in by_id[i] for i in held)
    r, h, inter = 4, 64, 128  # small_model: hidden 64, intermediate 128, 2 layers, 4 heads of 16 (kv = 4)
    per_layer = 4 * r * (h + h) + 2 * r * (h + inter) + r * (inter + h)  # q k v o; gate up; down
    assert trainer.num_trainable_params == 2 * per_layer == sum(p.numel() for p in pm.parameters() if p.requires_grad)


def test_engine_after_an_adapter_sync_gives_the_trainers_logprobs(small_model, tokenizer):
    """A trainer step, the adapters sent (and only they), and the engine's behaviour log-probs on what it
    samples next equal the trainer's log-probs of those tokens; the version tag is the trainer's."""
    pm = _lora(small_model)
    engine = LocalEngine(pm, tokenizer, SamplingConfig(max_new_tokens=6))
    trainer = Trainer(pm, AlgoConfig(), OptimConfig(lr=5e-2), TrainerConfig())
    trainer.step(_batch(engine, tokenizer, [[1.0, 0.0, 0.0, 0.0]] * 4))
    update = trainer.state_dict_for_engine()
    assert lora.is_adapter_update(update) and all(".lora_" in k for k in update)
    full = sum(v.numel() * 4 for v in small_model.state_dict().values())
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] < full / 5
    engine.request_weight_update(update, trainer.version)
    batch = _batch(engine, tokenizer, [[1.0, 0.0, 0.0, 1.0]] * 3)
    assert (batch.versions_bt[batch.loss_mask_bt.bool()] == 1).all()
    logp = trainer._scores(trainer.model, batch)
    mask = batch.loss_mask_bt.bool()
    torch.testing.assert_close(logp[mask], batch.behav_logp_bt[mask], atol=2e-5, rtol=0)
    assert (logp[mask] - _batch_logp_of_base(small_model, batch)[mask]).abs().max() > 1e-3, "weights must differ"


def _batch_logp_of_base(model, batch):
    return token_logprobs(model, batch.input_ids_bt, batch.attention_mask_bt)[0].detach()


def test_an_adapter_update_interrupts_generation_like_full_weights(small_model, tokenizer):
    """Mid-generation, an adapter update is applied at the next token boundary: tokens after it carry the new
    version, tokens before it the old one, as with full weights (rollout/local.py)."""
    pm = _lora(small_model)
    engine = LocalEngine(pm, tokenizer, SamplingConfig(max_new_tokens=12))
    moved = _lora(small_model)
    _perturb(moved)
    update = lora.adapter_update(moved)
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 4:
            engine.request_weight_update(update, version=3)
        return apply()

    engine._apply_pending_update = interrupt
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    trajs = engine.generate(group_requests(tokenizer, prompts, 4))
    assert engine.version == 3 and engine.num_interruptions == 1
    assert any(len(set(t.versions)) == 2 for t in trajs)
    assert all(t.versions == sorted(t.versions) for t in trajs)
    ids = torch.randint(3, 40, (2, 8))
    torch.testing.assert_close(token_logprobs(engine.model, ids, None)[0], token_logprobs(moved, ids, None)[0],
                               atol=2e-5, rtol=0)


def test_an_adapter_update_to_a_full_weight_engine_fails_loudly(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=2))
    engine.request_weight_update(lora.adapter_update(_lora(small_model)), 1)
    with pytest.raises(RuntimeError, match="adapter update"):
        engine._apply_pending_update()
