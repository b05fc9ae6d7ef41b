"""The stages take ``optim.*`` from ``tidal.optim`` (issue 53): RL's optimizers and schedules, the stages' defaults.

Before, ``stages/common.OptimConfig`` was an AdamW of its own (linear warm-up, then constant). Every one of its
keys (``lr``, ``betas``, ``weight_decay``, ``warmup_steps``, ``grad_clip``) keeps its name in ``tidal.optim``'s
config, so an old config or ``--set`` still means what it meant; ``optim.name`` and ``optim.schedule`` are new.
"""

import json
import math

import pytest
import torch

from tidal.config import ConfigError, apply_overrides
from tidal.optim import OptimConfig, lr_factor
from tidal.stages import dpo, reward_model, sft

from .conftest import SMALL


@pytest.mark.parametrize("cls, lr", [(sft.SFTStageConfig, 2e-5), (dpo.DPOStageConfig, 1e-6),
                                     (reward_model.RMStageConfig, 1e-4)])
def test_the_defaults_are_the_old_adamw(cls, lr):
    """The old stage AdamW's values (TRL's defaults): a stage trains as before unless told otherwise."""
    o = cls().optim
    assert isinstance(o, OptimConfig)
    assert (o.name, o.lr, tuple(o.betas), o.eps, o.weight_decay, o.warmup_steps, o.grad_clip, o.schedule) == (
        "adamw", lr, (0.9, 0.999), 1e-8, 0.0, 0, 1.0, "constant")


def _sft(domain, tmp_path, *sets):
    argv = [f"data.path={domain['sft']}", "run.steps=6", "run.eval_every=6", "run.save_every=6", "run.batch_size=4",
            "optim.lr=1e-3", "run.threads=1", "data.max_length=40", "model.tokenizer=chat",
            "run.async_checkpoint=false"]
    argv += [f"model.{k}={v}" for k, v in SMALL.items()] + list(sets)
    cfg = apply_overrides(sft.SFTStageConfig(), argv)
    sft.train(cfg, str(tmp_path), log=lambda s: None)
    return cfg, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_schedule_reaches_the_stage(domain, tmp_path):
    """Warm-up then cosine to min_lr_ratio, ending on the run's last step (decay_steps=max_steps): train/lr is
    tidal.optim's lr_factor, step by step."""
    cfg, rows = _sft(domain, tmp_path, "optim.warmup_steps=2", "optim.schedule=cosine", "optim.min_lr_ratio=0.1")
    resolved = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, decay_steps=4)
    want = [1e-3 * lr_factor(s, resolved) for s in range(6)]
    assert [r["train/lr"] for r in rows] == pytest.approx(want)
    assert want[1] == pytest.approx(1e-3) and want[-1] < 3e-4  # warm, then decayed towards the floor


@pytest.mark.parametrize("name", ["ademamix", "muon"])
def test_rl_optimizers_train_a_stage(name, domain, tmp_path):
    if name == "ademamix":
        pytest.importorskip("pytorch_optimizer")
    _, rows = _sft(domain, tmp_path, f"optim.name={name}")
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]


def test_the_old_default_lr_is_constant(domain, tmp_path):
    """No warm-up, constant: every step at optim.lr, as the old AdamW's LambdaLR (factor 1 with warmup 0)."""
    _, rows = _sft(domain, tmp_path)
    assert [r["train/lr"] for r in rows] == [1e-3] * 6


@pytest.mark.parametrize("sets, message", [
    (["optim.name=lion"], "optim.name='lion' is not an optimizer; one of adamw, ademamix, muon"),
    (["optim.name=muon", "model.lora.rank=2", "model.path=x"], "model.lora with optim.name=muon"),
    (["optim.schedule=steps"], "optim.schedule"),
])
def test_a_bad_optimizer_is_one_line_before_any_work(sets, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as e:
        cfg = apply_overrides(sft.SFTStageConfig(), ["data.path=/nonexistent.jsonl", *sets])
        sft.train(cfg, str(tmp_path / "r"), log=lambda s: None)
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


def test_an_old_stage_config_loads(tmp_path):
    """A config.yaml the old stage AdamW wrote (betas a list, no name/eps/schedule) reads into the new one."""
    from tidal.config import load_yaml_into

    path = tmp_path / "config.yaml"
    path.write_text("optim:\n  lr: 0.001\n  weight_decay: 0.0\n  betas:\n  - 0.9\n  - 0.999\n  warmup_steps: 3\n"
                    "  grad_clip: 1.0\n")
    o = load_yaml_into(dpo.DPOStageConfig(), path).optim
    assert (o.name, o.lr, tuple(o.betas), o.warmup_steps, o.schedule) == ("adamw", 1e-3, (0.9, 0.999), 3, "constant")
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)], betas=tuple(o.betas))  # a usable value
