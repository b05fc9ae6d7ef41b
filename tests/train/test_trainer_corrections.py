"""The trainer wires issue 17's pieces the way their papers define them, checked against losses written out
by hand on the tiny model (gradients compared, one step): DeepSeek-V3.2's off-policy sequence masking (the
correction needs the advantages), its importance-weighted KL (the KL needs the sampler's log-probs) and
REINFORCE++'s token-level returns (the estimator needs the mask and the per-token KL penalty)."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

from . import test_microbatching, test_trainer_objectives
from .test_trainer_objectives import ADV, assert_same, grads_of, logp_of, trainer_grads

setup = test_trainer_objectives.setup  # fixture: two groups of two, rewards (1, 0) and (0, 1), GRPO advantages ADV
batch = test_microbatching.batch  # fixture: three groups of three, response lengths 2..9


def test_offpolicy_sequence_masking_drops_drifted_negative_samples(setup):
    """DeepSeek-V3.2: loss = -M * A * pi / pi_old, M = 0 where A < 0 and mean_t log(pi_behav / pi_old) > delta."""
    model, batch = setup
    mask = batch.loss_mask_bt
    drift = torch.tensor([[0.3], [0.3], [0.05], [0.3]])  # ADV = [+, -, -, +]: only row 1 is both drifted and negative
    batch.behav_logp_bt = batch.behav_logp_bt + drift * mask
    with torch.no_grad():
        old = logp_of(model, batch)
    keep = torch.tensor([[1.0], [0.0], [1.0], [1.0]])

    def by_hand(m):
        logp = logp_of(m, batch)
        per_token = -keep * ADV[:, None] * (logp - old).exp()
        return (per_token * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, correction="reject", offpolicy_mask_delta=0.1)
    assert_same(got, want)
    assert metrics["algo/opsm_frac"] == pytest.approx(1 / 4)


def test_offpolicy_sequence_masking_is_the_same_over_micro_batches(small_model, batch):
    """Each micro-batch's correction gets its own rows' advantages: the split does not change the gradient."""
    batch = copy.copy(batch)
    batch.behav_logp_bt = batch.behav_logp_bt + 0.2 * batch.loss_mask_bt
    algo = AlgoConfig(correction="tis", offpolicy_mask_delta=0.1, is_veto_threshold=1e-4)
    grads = []
    for cfg in (TrainerConfig(), TrainerConfig(micro_batch_tokens=20)):
        model = copy.deepcopy(small_model)
        metrics = Trainer(model, algo, OptimConfig(lr=1e-3, grad_clip=1e9), cfg).step(batch)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert 0 < metrics["algo/opsm_frac"] < 1
    assert_same(grads[0], grads[1])


def _perturbed(small_model):
    ref_model = copy.deepcopy(small_model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref_model


def test_importance_weighted_kl_against_the_sampler(setup, small_model):
    """DeepSeek-V3.2's KL term: beta * token_mean((pi / pi_behav) * k3), the ratio differentiated."""
    model, batch = setup
    ref_model = _perturbed(small_model)
    mask = batch.loss_mask_bt
    batch.behav_logp_bt = batch.behav_logp_bt - 0.1 * mask  # stale samples: pi / pi_behav = e^0.1, inside the clip
    behav = batch.behav_logp_bt
    with torch.no_grad():
        ref = logp_of(ref_model, batch)

    def by_hand(m):
        logp = logp_of(m, batch)
        ratio = (logp - behav).exp()
        policy = -(ADV[:, None] * ratio)
        log_r = ref - logp
        kl = ratio * (log_r.exp() - 1 - log_r)
        return ((policy + 0.1 * kl) * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, ref_model=ref_model, kl_coef=0.1, kl_estimator="k3_is", dual_clip=None)
    assert_same(got, want)
    assert metrics["algo/kl"] > 0


def test_reinforce_pp_token_gets_the_kl_per_token_not_summed_into_the_reward(setup, small_model):
    """REINFORCE++: token reward -beta * k1_t, plus r - mean_group on the last response token; returns summed
    backwards; whitened over the batch's response tokens; loss -A_t * pi / pi_behav, token mean."""
    model, batch = setup
    ref_model = _perturbed(small_model)
    mask = batch.loss_mask_bt
    behav = batch.behav_logp_bt
    with torch.no_grad():
        ref = logp_of(ref_model, batch)
    rewards = batch.rewards_b
    centred = rewards - torch.tensor([0.5, 0.5, 0.5, 0.5])  # groups (1, 0) and (0, 1)
    token_reward = -0.5 * (behav - ref) * mask  # k1 on the sampled tokens, beta = 0.5
    returns = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        positions = mask[b].nonzero().flatten().tolist()
        token_reward[b, positions[-1]] += centred[b]
        running = 0.0
        for p in reversed(positions):
            running = running + token_reward[b, p].item()
            returns[b, p] = running
    values = returns[mask > 0]
    adv = (returns - values.mean()) / (values.std(unbiased=False) + 1e-6) * mask

    def by_hand(m):
        logp = logp_of(m, batch)
        return (-(adv * (logp - behav).exp()) * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, ref_model=ref_model, advantage="reinforce_pp_token", kl_coef=0.5,
                                 kl_estimator="k1", kl_in_reward=True, dual_clip=None)
    assert_same(got, want)
    penalty = (0.5 * (behav - ref) * mask).sum(-1).mean().item()
    assert metrics["algo/kl_reward_penalty"] == pytest.approx(penalty, rel=1e-5)
