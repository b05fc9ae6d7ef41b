"""Every optimizer drives the RL trainer: one step moves rewarded samples up (the trainer passes the model)."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt


@pytest.mark.parametrize("name", ["adamw", "ademamix", "muon"])
def test_one_trainer_step_with_each_optimizer(name, small_model, tokenizer):
    torch.manual_seed(0)
    model = copy.deepcopy(small_model)
    prompts = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(4)]
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=5))
    trajs = engine.generate(group_requests(tokenizer, prompts, 4))
    groups = [Group(p, trajs[i * 4 : (i + 1) * 4]) for i, p in enumerate(prompts)]
    for g in groups:
        for k, t in enumerate(g.trajectories):
            t.reward = 1.0 if k == 0 else 0.0
    batch, _ = build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(name=name, lr=1e-3), TrainerConfig())

    def logp_of_rewarded() -> float:
        with torch.no_grad():
            return sum(token_logprobs(model, ids := torch.tensor([t.prompt_ids + t.token_ids]),
                                      torch.ones_like(ids))[0][0, len(t.prompt_ids):].sum().item()
                       for t in (g.trajectories[0] for g in groups))

    before = logp_of_rewarded()
    metrics = trainer.step(batch)
    assert metrics["train/lr"] == pytest.approx(1e-3) and trainer.version == 1
    assert logp_of_rewarded() > before
