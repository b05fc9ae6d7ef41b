"""Weight sync of a tied model (issue 49: SmolLM2's tied embedding travelled twice): the trainer sends each
parameter once, ``perf/weight_sync_bytes`` counts the unique bytes, the engine's copy stays tied and its
log-probs after the sync are the trainer's; an untied model still sends its head."""

import copy

import torch

from tidal.algo.config import AlgoConfig
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Prompt

from ..models.test_tied import untied


def _trainer(model):
    return Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(), TrainerConfig())


def _unique_bytes(model, dtype=None):
    return sum(p.numel() * (p.element_size() if dtype is None else dtype.itemsize) for p in model.parameters())


def test_a_tied_embedding_is_sent_once(small_model):
    trainer = _trainer(small_model)
    sd = trainer.state_dict_for_engine()
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == _unique_bytes(trainer.model)
    trainer.state_dict_for_engine(dtype=torch.bfloat16)
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == _unique_bytes(trainer.model, torch.bfloat16)
    packed = trainer.state_dict_for_engine("fp8_block")
    assert "lm_head.weight" not in packed and packed["model.embed_tokens.weight"].dtype == torch.float32


def test_an_untied_model_sends_its_head(small_model):
    trainer = _trainer(untied(small_model))
    sd = trainer.state_dict_for_engine()
    assert sd.keys() == trainer.model.state_dict().keys()
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == _unique_bytes(trainer.model)
    assert _unique_bytes(trainer.model) > _unique_bytes(small_model)


def _max_gap(engine, trainer, tokenizer) -> float:
    prompts = [Prompt(f"p{i}", f"{i}+{i + 3}=", "") for i in range(4)]
    trajs = engine.generate(group_requests(tokenizer, prompts, 2))
    gap = 0.0
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.token_ids])
            logp = token_logprobs(trainer.model, ids, None)[0][0, len(t.prompt_ids):]
            gap = max(gap, (logp - torch.tensor(t.logprobs)).abs().max().item())
    return gap


def test_the_engine_stays_tied_and_matches_the_trainer_after_a_sync(small_model, tokenizer):
    for model, quant in ((small_model, "none"), (small_model, "fp8_block"), (untied(small_model), "none")):
        trainer = _trainer(model)
        engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=6))
        embed = trainer.model.model.embed_tokens.weight
        with torch.no_grad():  # a new embedding: with tied weights, a new head as well
            embed.add_(0.05 * torch.randn_like(embed))
        assert _max_gap(engine, trainer, tokenizer) > 1e-2
        engine.request_weight_update(trainer.state_dict_for_engine(quant), 1)
        gap = _max_gap(engine, trainer, tokenizer)
        assert engine.version == 1
        assert gap < 1e-5 if quant == "none" else 1e-5 < gap < 0.5, (quant, gap)
        tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
        assert tied == (model is small_model)
        assert torch.equal(engine.model.lm_head.weight, trainer.model.lm_head.weight)  # the head stays full precision
