"""The trainer wires every objective part the way the papers define them: checked against losses
written out by hand on the same tiny model and batch (gradients compared, one step)."""

import copy
import math

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

from .test_trainer import _groups

# Two groups of two: rewards (1, 0) and (0, 1). GRPO: mean 0.5, unbiased std sqrt(0.5) per group.
REWARDS = [[1.0, 0.0], [0.0, 1.0]]
A = 0.5 / (math.sqrt(0.5) + 1e-6)
ADV = torch.tensor([A, -A, -A, A])


@pytest.fixture
def setup(small_model, tokenizer):
    model = copy.deepcopy(small_model)
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=5))
    batch, _ = build_train_batch(_groups(engine, tokenizer, REWARDS), AlgoConfig(), tokenizer.pad_token_id)
    return model, batch


def grads_of(model, loss_fn):
    """Gradient of a hand-written loss on a copy of ``model``."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    loss_fn(ref).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def trainer_grads(model, batch, ref_model=None, **algo):
    trainer = Trainer(model, AlgoConfig(**algo), OptimConfig(lr=1e-3, grad_clip=1e9), TrainerConfig(),
                      ref_model=ref_model)
    metrics = trainer.step(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


def assert_same(a, b):
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6, rtol=1e-4), n


def logp_of(model, batch):
    return token_logprobs(model, batch.input_ids_bt, batch.attention_mask_bt)[0]


def entropy_of(model, batch):
    """Per-token entropies of the next-token distribution, the textbook way: full logits, -sum p log p."""
    logits = model(input_ids=batch.input_ids_bt, attention_mask=batch.attention_mask_bt).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    return torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))


def test_tis_weights_each_token_by_the_truncated_engine_ratio(setup):
    """Yao et al.: loss = -min(pi_old / pi_behav, C) * A * pi / pi_old, token-mean; C = 2."""
    model, batch = setup
    mask = batch.loss_mask_bt
    shift = torch.zeros_like(mask)
    shift[:, ::2] = 1.0  # engine log-probs off by -1 on every other position: ratio e > C there
    batch.behav_logp_bt = batch.behav_logp_bt - shift * mask
    with torch.no_grad():
        old = logp_of(model, batch)
    w = torch.minimum((old - batch.behav_logp_bt).exp(), torch.tensor(2.0))

    def by_hand(m):
        logp = logp_of(m, batch)
        per_token = -w * ADV[:, None] * (logp - old).exp()
        return (per_token * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, correction="tis")
    assert_same(got, want)
    assert 0 < metrics["algo/tis_frac"] < 1


def test_kl_loss_against_the_reference_model(setup, small_model):
    """GRPO's KL term: loss += beta * token_mean(k3), k3 = r - 1 - log r, r = pi_ref / pi."""
    model, batch = setup
    ref_model = copy.deepcopy(small_model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        ref = logp_of(ref_model, batch)
    mask = batch.loss_mask_bt
    behav = batch.behav_logp_bt

    def by_hand(m):
        logp = logp_of(m, batch)
        ratio = (logp - behav).exp()  # == 1 in value (fresh samples); carries the gradient
        policy = -(ADV[:, None] * ratio)
        log_r = ref - logp
        k3 = log_r.exp() - 1 - log_r
        return ((policy + 0.1 * k3) * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, ref_model=ref_model, kl_coef=0.1, dual_clip=None)
    assert_same(got, want)
    assert metrics["algo/kl"] > 0


def test_kl_in_reward_lowers_rewards_before_the_advantage(setup, small_model):
    model, batch = setup
    ref_model = copy.deepcopy(small_model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        ref = logp_of(ref_model, batch)
    mask = batch.loss_mask_bt
    log_r = ref - batch.behav_logp_bt
    k3_sum = ((log_r.exp() - 1 - log_r) * mask).sum(-1)  # the configured estimator, k3, per sequence
    _, metrics = trainer_grads(model, batch, ref_model=ref_model, kl_coef=0.5, kl_in_reward=True)
    assert metrics["algo/kl_reward_penalty"] == pytest.approx(0.5 * k3_sum.mean().item(), rel=1e-5)


def test_ess_scaled_learning_rate(setup):
    """VCPO: lr x sqrt(min(1, ESS)), ESS of the sequence weights pi / pi_behav, (sum w)^2 / (n sum w^2)."""
    model, batch = setup
    batch.behav_logp_bt = batch.behav_logp_bt - batch.loss_mask_bt * torch.tensor([[0.0], [0.5], [1.0], [0.2]])
    with torch.no_grad():
        log_w = ((logp_of(model, batch) - batch.behav_logp_bt) * batch.loss_mask_bt).sum(-1).double()
    w = log_w.exp()
    ess = (w.sum() ** 2 / (4 * (w * w).sum())).item()
    _, metrics = trainer_grads(model, batch, ess_lr_scaling=True)
    assert metrics["algo/seq_ess"] == pytest.approx(ess, rel=1e-5)
    assert metrics["algo/lr_scale"] == pytest.approx(math.sqrt(ess), rel=1e-5)
    _, plain = trainer_grads(copy.deepcopy(model), batch)
    assert plain["algo/lr_scale"] == 1.0


def test_magistral_normalizes_advantages_per_minibatch(setup):
    """Magistral: group-mean baseline, then (A - mean) / std over each minibatch."""
    model, batch = setup
    # minibatch 1 = group 0 (advantages +0.5, -0.5), minibatch 2 = group 1 (-0.5, +0.5): each whitens to +-1
    trainer = Trainer(model, AlgoConfig(advantage="magistral"), OptimConfig(lr=1e-3), TrainerConfig(num_minibatches=2))
    metrics = trainer.step(batch)
    assert metrics["algo/adv_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["algo/adv_min"] == pytest.approx(-1.0, abs=1e-4)


def test_decoupled_ppo_uses_the_proximal_policy_across_minibatches(setup):
    """AReaL: the second minibatch's ratio is against pi_prox (weights before the step), so it moved
    away from 1 after the first update; the behaviour weight pi_prox / pi_behav is 1 on fresh samples."""
    model, batch = setup
    trainer = Trainer(model, AlgoConfig(policy_loss="decoupled_ppo"), OptimConfig(lr=5e-2),
                      TrainerConfig(num_minibatches=2))
    metrics = trainer.step(batch)
    assert metrics["algo/behav_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["algo/ratio_max"] > 1.0 + 1e-4 or metrics["algo/ratio_min"] < 1.0 - 1e-4


def test_overlong_filter_masks_truncated_samples(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=2))
    groups = _groups(engine, tokenizer, REWARDS)
    cut = sum(t.finish_reason == "length" for g in groups for t in g.trajectories)
    assert cut > 0
    batch, metrics = build_train_batch(groups, AlgoConfig(overlong_filter=True), tokenizer.pad_token_id)
    assert metrics["algo/overlong_filtered"] == cut
    trajs = [t for g in groups for t in g.trajectories]
    assert [batch.loss_mask_bt[i].sum().item() == 0 for i in range(4)] == [t.finish_reason == "length" for t in trajs]


def test_entropy_bonus_subtracts_the_token_mean_entropy(setup):
    """Entropy bonus (PPO eq. 9): loss -= c * token_mean(H), with H's own gradient."""
    model, batch = setup
    mask = batch.loss_mask_bt

    def by_hand(m):
        policy = -(ADV[:, None] * (logp_of(m, batch) - batch.behav_logp_bt).exp())
        return ((policy - 0.05 * entropy_of(m, batch)) * mask).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, entropy_coef=0.05)
    assert_same(got, want)
    with torch.no_grad():
        bonus = 0.05 * ((entropy_of(model, batch) * mask).sum() / mask.sum()).item()
    assert metrics["algo/entropy_bonus"] == pytest.approx(bonus, rel=1e-4)


def test_top_entropy_frac_trains_only_the_high_entropy_tokens(setup):
    """Beyond the 80/20 Rule: only tokens with entropy >= the ceil(rho N)-th largest get the policy loss,
    each with the weight it has in the full token mean."""
    model, batch = setup
    mask = batch.loss_mask_bt
    with torch.no_grad():
        ent = entropy_of(model, batch)
    values = ent[mask > 0]
    threshold = values.sort(descending=True).values[math.ceil(0.5 * values.numel()) - 1]
    keep = ((mask > 0) & (ent >= threshold)).float()

    def by_hand(m):
        policy = -(ADV[:, None] * (logp_of(m, batch) - batch.behav_logp_bt).exp())
        return (policy * keep).sum() / mask.sum()

    want = grads_of(model, by_hand)
    got, metrics = trainer_grads(model, batch, top_entropy_frac=0.5)
    assert_same(got, want)
    assert 0 < keep.sum() < mask.sum()
    assert metrics["algo/entropy_kept_frac"] == pytest.approx((keep.sum() / mask.sum()).item())
