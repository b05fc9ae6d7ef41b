"""build_optimizer: the registry, Muon's parameter split, one schedule over every group, checkpoint round trips."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.config import apply_overrides
from tidal.optim import OPTIMIZERS, CombinedOptimizer, Muon, OptimConfig, build_optimizer, split_hidden_matrices
from tidal.train.checkpoint import TrainingState, load_checkpoint, save_checkpoint


def _names(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def _batch(seed=0):
    return torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(seed))


def _train_step(model, opt, sched, ids):
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def test_registry_and_overrides():
    assert OPTIMIZERS.names() == ["adamw", "ademamix", "muon"]
    cfg = apply_overrides(OptimConfig(), ["name=muon", "muon.momentum=0.9", "ademamix.warmup_steps=100"])
    assert (cfg.name, cfg.muon.momentum, cfg.ademamix.warmup_steps) == ("muon", 0.9, 100)
    with pytest.raises(KeyError, match="did you mean 'muon'"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimConfig(name="muom"))


def test_default_is_the_old_adamw(small_model):
    opt, _ = build_optimizer(small_model, OptimConfig())
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-4, (0.9, 0.99), 1e-8, 0.0)
    # A plain iterable of parameters still works for the optimizers that need no names.
    assert type(build_optimizer(small_model.parameters(), OptimConfig(name="ademamix"))[0]).__name__ == "AdEMAMix"


def test_muon_needs_the_model():
    with pytest.raises(TypeError, match="needs the model"):
        build_optimizer([torch.nn.Parameter(torch.zeros(4, 4))], OptimConfig(name="muon"))


def test_split_sends_embeddings_head_norms_and_biases_to_adamw(small_model):
    muon, adamw = split_hidden_matrices(small_model)
    muon_names, adamw_names = _names(small_model, muon), _names(small_model, adamw)
    assert muon_names and all(n.startswith("model.layers.") and n.endswith("proj.weight") for n in muon_names)
    assert len(muon_names) == 7 * len(small_model.model.layers)  # q, k, v, o, gate, up, down
    assert "model.embed_tokens.weight" in adamw_names  # tied: also the head
    assert any(n.endswith("norm.weight") for n in adamw_names) and any(n.endswith(".bias") for n in adamw_names)
    assert all(p.ndim == 1 for n, p in small_model.named_parameters() if n in adamw_names and "embed" not in n)


def test_split_with_an_untied_head():
    config = Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    muon, adamw = split_hidden_matrices(model)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= _names(model, adamw)
    assert "lm_head.weight" not in _names(model, muon)


def test_muon_is_one_optimizer_and_one_schedule_scales_every_group(small_model):
    model = copy.deepcopy(small_model)
    opt, sched = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, warmup_steps=4))
    assert isinstance(opt, CombinedOptimizer) and isinstance(opt.optimizers[0], Muon)
    assert type(opt.optimizers[1]) is torch.optim.AdamW
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(2.5e-4)] * 2  # warm-up step 1 of 4
    _train_step(model, opt, sched, _batch())
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(5e-4)] * 2
    for group in opt.param_groups:  # the trainer's one-step lr scaling
        group["lr"] *= 0.5
    assert [child.param_groups[0]["lr"] for child in opt.optimizers] == [pytest.approx(2.5e-4)] * 2
    sched.step()  # recomputed from the base lr
    assert [child.param_groups[0]["lr"] for child in opt.optimizers] == [pytest.approx(7.5e-4)] * 2


@pytest.mark.parametrize("name", ["adamw", "ademamix", "muon"])
def test_checkpoint_round_trip(name, small_model, tokenizer, tmp_path):
    cfg = OptimConfig(name=name, lr=1e-3, weight_decay=0.1, warmup_steps=3)
    cfg.ademamix.warmup_steps = 10
    model = copy.deepcopy(small_model)
    opt, sched = build_optimizer(model, cfg)
    for i in range(3):
        _train_step(model, opt, sched, _batch(i))
    path = save_checkpoint(tmp_path, model, tokenizer, opt, sched, TrainingState(3, 3, 0, {}))

    fresh = copy.deepcopy(small_model)
    fresh_opt, fresh_sched = build_optimizer(fresh, cfg)
    load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    if name == "muon":  # the children see the restored groups and state, not the ones they were built with
        assert fresh_opt.optimizers[0].param_groups[0] is fresh_opt.param_groups[0]
        assert fresh_opt.optimizers[1].state is fresh_opt.state
    for m, o, s in ((model, opt, sched), (fresh, fresh_opt, fresh_sched)):
        _train_step(m, o, s, _batch(99))
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


def test_lr_factor_warm_up_then_each_schedule_by_hand():
    from tidal.optim import lr_factor

    const = OptimConfig(warmup_steps=4)
    assert [lr_factor(s, const) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(warmup_steps=2, schedule="cosine", decay_steps=4, min_lr_ratio=0.1)
    # after warm-up (steps 0, 1): 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..4, then held at 0.1
    want = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + 2 ** -0.5) / 2, 0.55, 0.1 + 0.9 * (1 - 2 ** -0.5) / 2, 0.1, 0.1]
    assert [lr_factor(s, cos) for s in range(8)] == pytest.approx(want)
    lin = OptimConfig(schedule="linear", decay_steps=4, min_lr_ratio=0.0)
    assert [lr_factor(s, lin) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_the_decay_drives_the_optimizer_and_survives_a_state_dict_round_trip(small_model):
    cfg = OptimConfig(lr=1e-3, schedule="cosine", decay_steps=10, min_lr_ratio=0.1)
    opt, sched = build_optimizer(small_model, cfg)
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.55)  # halfway down the cosine
    opt2, sched2 = build_optimizer(small_model, cfg)
    sched2.load_state_dict(sched.state_dict())
    opt2.step()
    sched2.step()
    sched.step()
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_decay_steps_default_follows_the_run_length(small_model):
    """``decay_steps=max_steps`` (the default) decays until the run's last optimizer step, after warm-up; an
    integer is kept; without the run's length a decaying schedule is refused, naming the key."""
    from tidal.config import ConfigError
    from tidal.optim import for_run, lr_factor

    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert cfg.decay_steps == "max_steps"
    assert for_run(cfg, 10).decay_steps == 8 and cfg.decay_steps == "max_steps"  # a copy: the config is not baked
    assert for_run(OptimConfig(schedule="cosine", decay_steps=5), 10).decay_steps == 5
    opt, sched = build_optimizer(small_model, cfg, num_steps=10)
    lrs = []
    for _ in range(10):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[-1] == pytest.approx(0.1) and lrs[-2] > 0.1 + 1e-3  # the floor after the 10th step, not before
    assert lrs == pytest.approx([lr_factor(s, for_run(cfg, 10)) for s in range(1, 11)])
    with pytest.raises(ConfigError, match="optim.decay_steps=max_steps"):
        build_optimizer(small_model, cfg)
    build_optimizer(small_model, OptimConfig())  # constant: no length needed
    assert apply_overrides(OptimConfig(), ["decay_steps=300"]).decay_steps == 300
    assert apply_overrides(OptimConfig(decay_steps=300), ["decay_steps=max_steps"]).decay_steps == "max_steps"
    with pytest.raises(ConfigError, match="decay_steps"):
        apply_overrides(OptimConfig(), ["decay_steps=forever"])
