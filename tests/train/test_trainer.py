import pytest
import torch

from tidal.algo import mismatch_metrics
from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.host_batch import read_metrics
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt


def _groups(engine, tokenizer, rewards):
    prompts = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(len(rewards))]
    trajs = engine.generate(group_requests(tokenizer, prompts, len(rewards[0])))
    n = len(rewards[0])
    groups = [Group(p, trajs[i * n : (i + 1) * n]) for i, p in enumerate(prompts)]
    for g, rs in zip(groups, rewards):
        for t, r in zip(g.trajectories, rs):
            t.reward = r
    return groups


def test_batch_layout_and_zero_advantage_filter(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=5))
    groups = _groups(engine, tokenizer, [[1.0, 0.0], [1.0, 1.0]])
    batch, metrics = build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)
    assert metrics["algo/zero_adv_groups"] == 1.0
    assert batch.num_sequences == 2  # the all-equal group is dropped
    for r, t in enumerate(groups[0].trajectories):
        p, n = len(t.prompt_ids), t.num_tokens
        assert batch.input_ids_bt[r, : p + n].tolist() == t.prompt_ids + t.token_ids
        assert batch.loss_mask_bt[r].sum() == n and batch.loss_mask_bt[r, :p].sum() == 0
        assert torch.allclose(batch.behav_logp_bt[r, p : p + n], torch.tensor(t.logprobs))
    assert batch.rewards_b.tolist() == [1.0, 0.0] and batch.group_index_b.tolist() == [0, 0]


def test_trainer_step_on_fresh_samples_is_on_policy_and_moves_toward_reward(small_model, tokenizer):
    import copy

    model = copy.deepcopy(small_model)
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=5))
    groups = _groups(engine, tokenizer, [[1.0, 0.0, 0.0, 0.0]] * 4)
    batch, _ = build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig())
    good = [g.trajectories[0] for g in groups]

    def logp_of(trajs):
        from tidal.models.logprobs import token_logprobs

        total = 0.0
        with torch.no_grad():
            for t in trajs:
                ids = torch.tensor([t.prompt_ids + t.token_ids])
                total += token_logprobs(model, ids, torch.ones_like(ids))[0][0, len(t.prompt_ids):].sum().item()
        return total

    before = logp_of(good)
    metrics = trainer.step(batch)
    assert metrics["train/logp_mismatch_mean"] < 1e-4  # engine and trainer score the same tokens alike
    assert abs(metrics["algo/ratio_mean"] - 1.0) < 1e-4 and metrics["algo/clip_frac"] == 0.0
    assert trainer.version == 1
    assert logp_of(good) > before  # rewarded samples became more likely


def test_minibatches_keep_groups_whole_and_even():
    from tidal.train.trainer import minibatches

    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    # 12 rows in 3 groups of 4, two minibatches: the even split point 6 is not a group boundary; the
    # closest boundaries are 4 and 8 (a tie, resolved to the first)
    assert [c.tolist() for c in minibatches(groups, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [len(c) for c in minibatches(groups, 3)] == [4, 4, 4]
    assert [len(c) for c in minibatches(groups, 8)] == [4, 4, 4]  # never more minibatches than groups
    assert [len(c) for c in minibatches(torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]), 2)] == [2, 6]
    assert [c.tolist() for c in minibatches(groups, 1)] == [list(range(12))]


def test_mismatch_metrics_against_hand_computed_values():
    """Fresh tokens only; k3 KL(engine || trainer) = r - 1 - log r with r = pi_train / pi_engine; extreme: ratio > 2."""
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5, -3.0]])
    behav = torch.tensor([[0.0, -1.1, -1.0, -0.5, -9.0]])
    versions = torch.tensor([[-1, 0, 0, 0, 1]])  # the last token: another version's, not fresh
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    got = read_metrics(mismatch_metrics(logp, behav, versions, mask, version=0))
    log_r = torch.tensor([0.1, -1.0, 0.0])
    assert got["train/logp_mismatch_mean"] == pytest.approx((0.1 + 1.0 + 0.0) / 3)
    assert got["train/logp_mismatch_max"] == pytest.approx(1.0)
    assert got["train/logp_mismatch_kl"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()), rel=1e-6)
    assert got["train/extreme_token_frac"] == pytest.approx(1 / 3)  # |log r| = 1 > log 2
