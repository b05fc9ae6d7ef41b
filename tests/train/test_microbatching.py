"""Gradient accumulation over micro-batches (padded, packed or prefix-shared) gives the whole minibatch's
gradient, whatever the aggregation: the split must not change the result."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

from .test_trainer import _groups


def long_tailed_batch(small_model, tokenizer):
    """Three sampled groups of three, their responses cut to long-tailed lengths 2..9."""
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=9))
    groups = _groups(engine, tokenizer, [[1.0, 0.0, 0.5], [0.0, 1.0, 1.0], [0.2, 0.0, 1.0]])
    for k, t in enumerate(t for g in groups for t in g.trajectories):
        n = 2 + (k * 3) % 8
        t.token_ids, t.logprobs, t.versions = t.token_ids[:n], t.logprobs[:n], t.versions[:n]
    return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]


@pytest.fixture(scope="module")
def batch(small_model, tokenizer):
    batch = long_tailed_batch(small_model, tokenizer)
    lengths = batch.attention_mask_bt.sum(-1)
    assert len(set(lengths.tolist())) > 1, "the check needs sequences of different lengths"
    return batch


def grads_after_step(model, batch, algo: AlgoConfig, trainer_cfg: TrainerConfig):
    model = copy.deepcopy(model)
    trainer = Trainer(model, algo, OptimConfig(lr=1e-3, grad_clip=1e9), trainer_cfg)
    metrics = trainer.step(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "group_length"])
@pytest.mark.parametrize("split", [{"micro_batch_tokens": 20}, {"micro_batch_tokens": 30, "packing": True,
                                                                 "pack_tokens": 16},
                                   {"share_prefixes": True, "pack_tokens": 16},
                                   {"micro_batch_tokens": 30, "share_prefixes": True}])
def test_micro_batches_sum_to_the_whole(small_model, batch, agg, split):
    algo = AlgoConfig(loss_agg=agg, max_gen_len=9)
    whole, m_whole = grads_after_step(small_model, batch, algo, TrainerConfig())
    parts, m_parts = grads_after_step(small_model, batch, algo, TrainerConfig(**split))
    for n in whole:
        assert torch.allclose(whole[n], parts[n], atol=1e-6, rtol=1e-4), n
    assert m_parts["train/loss"] == pytest.approx(m_whole["train/loss"], rel=1e-4, abs=1e-7)
    assert m_parts["train/entropy"] == pytest.approx(m_whole["train/entropy"], rel=1e-5)


def test_micro_batches_with_corrections_and_kl(small_model, batch):
    algo = AlgoConfig(policy_loss="decoupled_ppo", kl_coef=0.1, correction="tis")
    ref = copy.deepcopy(small_model)
    results = []
    for cfg in (TrainerConfig(), TrainerConfig(micro_batch_tokens=20),
                TrainerConfig(micro_batch_tokens=30, packing=True, pack_tokens=16),
                TrainerConfig(share_prefixes=True, pack_tokens=16)):
        model = copy.deepcopy(small_model)
        trainer = Trainer(model, algo, OptimConfig(lr=1e-3, grad_clip=1e9), cfg, ref_model=ref)
        trainer.step(batch)
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for other in results[1:]:
        for n in results[0]:
            assert torch.allclose(results[0][n], other[n], atol=1e-6, rtol=1e-4), n


@pytest.mark.parametrize("loss", ["sapo", "gmpo"])
def test_micro_batches_with_the_entropy_bonus_and_sequence_level_losses(small_model, batch, loss):
    """Differentiable entropies go through padded, packed and prefix-shared layouts; the bonus (and SAPO's
    and GMPO's per-sequence terms) still sum over micro-batches to the whole minibatch's gradient."""
    algo = AlgoConfig(policy_loss=loss, entropy_coef=0.05)
    whole, m_whole = grads_after_step(small_model, batch, algo, TrainerConfig())
    for split in ({"micro_batch_tokens": 20}, {"micro_batch_tokens": 30, "packing": True, "pack_tokens": 16},
                  {"micro_batch_tokens": 30, "share_prefixes": True}):
        parts, m_parts = grads_after_step(small_model, batch, algo, TrainerConfig(**split))
        for n in whole:
            assert torch.allclose(whole[n], parts[n], atol=1e-6, rtol=1e-4), (split, n)
        assert m_parts["algo/entropy_bonus"] == pytest.approx(m_whole["algo/entropy_bonus"], rel=1e-5)
    plain, _ = grads_after_step(small_model, batch, AlgoConfig(policy_loss=loss), TrainerConfig())
    assert any(not torch.allclose(whole[n], plain[n], atol=1e-6, rtol=1e-4) for n in whole), "no bonus gradient"


def test_activation_checkpointing_keeps_the_gradient(small_model, batch):
    plain, _ = grads_after_step(small_model, batch, AlgoConfig(), TrainerConfig())
    ckpt, metrics = grads_after_step(small_model, batch, AlgoConfig(), TrainerConfig(activation_checkpointing=True,
                                                                                      logprob_chunk_size=7))
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-6, rtol=1e-4), n
    assert metrics["perf/peak_mem_gb"] > 0
