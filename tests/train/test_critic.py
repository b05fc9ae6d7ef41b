"""The critic in the trainer step (``algo.advantage=gae``): wired as written by hand, learning on a fixed
batch, checkpointed and resumed exactly, and refused where it cannot run yet."""

import copy

import pytest
import torch

from tidal.algo import VALUE_ADVANTAGES
from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.batch import build_train_batch
from tidal.train.checkpoint import TrainingState
from tidal.train.config import TrainerConfig
from tidal.train.critic import CriticConfig, check_supported
from tidal.train.trainer import Trainer

from .test_trainer import _groups

NO_CLIP = OptimConfig(lr=1e-3, grad_clip=1e9)


def _batch(model, tokenizer, rewards, max_new_tokens=5):
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=max_new_tokens))
    algo = AlgoConfig(skip_zero_adv_groups=False)
    return build_train_batch(_groups(engine, tokenizer, rewards), algo, tokenizer.pad_token_id)[0]


@pytest.fixture
def setup(small_model, tokenizer):
    model = copy.deepcopy(small_model)
    return model, _batch(model, tokenizer, [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def _trainer(model, trainer_cfg=None, optim=NO_CLIP, **algo):
    return Trainer(model, AlgoConfig(advantage="gae", **algo), optim, trainer_cfg or TrainerConfig(),
                   critic=CriticConfig(optim=optim))


def _random_head(trainer, seed=0):
    """A non-zero value head, so the values (and the backbone's gradients) are not all zero."""
    torch.nn.init.normal_(trainer.critic.model.head.weight, std=0.3, generator=torch.Generator().manual_seed(seed))


def test_the_step_trains_policy_and_critic_as_written_by_hand(setup):
    """Policy: PPO's surrogate, token mean, with the GAE advantages of the critic's values before the
    step (on-policy, ratio 1: no clipping). Critic: 1/2 (V - R)^2, token mean (V = V_old: no clipping)."""
    model, batch = setup
    trainer = _trainer(model, gamma=0.9, lam=0.8)
    _random_head(trainer)
    policy, critic = copy.deepcopy(model), copy.deepcopy(trainer.critic.model)
    ids, attn, mask = batch.input_ids_bt, batch.attention_mask_bt, batch.loss_mask_bt
    with torch.no_grad():
        old_values = critic(ids, attn)
    adv, ret = VALUE_ADVANTAGES["gae"](batch.rewards_b, old_values, mask, gamma=0.9, lam=0.8)
    assert adv[mask > 0].abs().min() > 0, "a zero advantage would hide a wiring error"
    logp = token_logprobs(policy, ids, attn)[0]
    (-(logp - batch.behav_logp_bt).exp() * adv * mask).sum().div(mask.sum()).backward()
    (0.5 * (critic(ids, attn) - ret) ** 2 * mask).sum().div(mask.sum()).backward()

    metrics = trainer.step(batch)
    for mine, ref in ((model, policy), (trainer.critic.model, critic)):
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["algo/clip_frac"] == 0.0 and metrics["critic/clip_frac"] == 0.0
    expected = (0.5 * (old_values - ret) ** 2 * mask).sum() / mask.sum()
    assert metrics["critic/value_loss"] == pytest.approx(expected.item(), rel=1e-5)
    for key in ("critic/values_mean", "critic/explained_var", "critic/grad_norm", "critic/returns_mean"):
        assert key in metrics


def test_micro_batches_give_the_critic_the_same_update(setup):
    model, batch = setup
    whole, split = _trainer(copy.deepcopy(model)), _trainer(copy.deepcopy(model), TrainerConfig(micro_batch_tokens=16))
    for t in (whole, split):
        _random_head(t)
        t.step(batch)
    assert len(split._micro_batches(batch, torch.arange(batch.num_sequences))) > 1
    for (name, p), q in zip(whole.critic.model.named_parameters(), split.critic.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_each_minibatch_steps_the_critic_once(setup):
    model, batch = setup
    trainer = _trainer(model, TrainerConfig(num_minibatches=3))
    trainer.step(batch)
    assert trainer.critic.scheduler.last_epoch == trainer.scheduler.last_epoch == 3
    assert all(s["step"] == 3 for s in trainer.critic.optimizer.state_dict()["state"].values())


def test_the_value_loss_falls_on_a_fixed_batch(setup):
    """The same batch trained again and again: the critic fits its returns (rewards, gamma = lam = 1).
    Each step's loss is measured before that step's update."""
    model, batch = setup
    trainer = Trainer(model, AlgoConfig(advantage="gae"), OptimConfig(lr=1e-4), TrainerConfig(),
                      critic=CriticConfig(optim=OptimConfig(lr=3e-3)))
    history = [trainer.step(batch) for _ in range(12)]
    losses = [m["critic/value_loss"] for m in history]
    assert losses[0] == pytest.approx(0.5 * (batch.rewards_b[:, None] ** 2 * batch.loss_mask_bt).sum().item()
                                      / batch.loss_mask_bt.sum().item(), rel=1e-5)  # V = 0 at the start
    assert losses[-1] < 0.25 * losses[0], losses
    assert history[-1]["critic/explained_var"] > 0.5 > history[0]["critic/explained_var"]


def test_a_checkpoint_resumes_policy_and_critic_exactly(tmp_path, small_model, tokenizer):
    base = copy.deepcopy(small_model)
    first, second = _batch(base, tokenizer, [[1.0, 0.0], [1.0, 1.0]]), _batch(base, tokenizer, [[0.0, 1.0], [0.0, 0.0]])

    def fresh():
        return _trainer(copy.deepcopy(base), optim=OptimConfig(lr=1e-2))

    a = fresh()
    a.step(first)
    path = a.save_checkpoint(tmp_path / "checkpoints", tokenizer, TrainingState(1, a.version, 2, {}))
    assert (path / "critic.pt").exists()
    after = a.step(second)

    b = fresh()
    assert not torch.equal(b.critic.model.head.weight, a.critic.model.head.weight)
    state = b.load_checkpoint(path)
    assert (state.step, b.version) == (1, 1)
    resumed = b.step(second)
    assert {k: v for k, v in resumed.items() if k.startswith(("critic/", "algo/", "train/loss"))} == \
           {k: v for k, v in after.items() if k.startswith(("critic/", "algo/", "train/loss"))}
    for x, y in ((a.model, b.model), (a.critic.model, b.critic.model)):
        assert all(torch.equal(p, q) for p, q in zip(x.state_dict().values(), y.state_dict().values()))
    sa, sb = a.critic.optimizer.state_dict()["state"], b.critic.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def test_a_checkpoint_without_a_critic_is_refused(tmp_path, small_model, tokenizer):
    plain = Trainer(copy.deepcopy(small_model), AlgoConfig(), NO_CLIP, TrainerConfig())
    path = plain.save_checkpoint(tmp_path, tokenizer, TrainingState(1, 1, 2, {}))
    with pytest.raises(RuntimeError, match=r"no critic\.pt.*algo\.advantage=gae"):
        _trainer(copy.deepcopy(small_model)).load_checkpoint(path)
    assert not (path / "critic.pt").exists()


@pytest.mark.parametrize("layout", [dict(packing=True, pack_tokens=40), dict(share_prefixes=True, pack_tokens=40),
                                    dict(packing=True, micro_batch_tokens=30, pack_tokens=30)])
def test_packed_layouts_give_the_critic_the_padded_values_and_update(setup, layout):
    """The critic scores each layout the policy can be trained in; the values (and so the advantages,
    returns and the critic's step) equal the padded layout's."""
    model, batch = setup
    padded, packed = _trainer(copy.deepcopy(model)), _trainer(copy.deepcopy(model), TrainerConfig(**layout))
    everything = torch.arange(batch.num_sequences)
    for t in (padded, packed):
        _random_head(t)
    mask = batch.loss_mask_bt
    with torch.no_grad():
        expected, got = padded.critic.values(batch, everything), packed.critic.values(batch, everything)
    torch.testing.assert_close(got * mask, expected * mask, atol=1e-5, rtol=1e-5)
    assert got.abs().sum() > 0
    a, b = padded.step(batch), packed.step(batch)
    assert b["critic/value_loss"] == pytest.approx(a["critic/value_loss"], rel=1e-5)
    for (name, p), q in zip(padded.critic.model.named_parameters(), packed.critic.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_data_parallel_is_a_config_error():
    with pytest.raises(ConfigError, match=r"trainer.data_parallel=diloco"):
        check_supported(TrainerConfig(data_parallel="diloco"), data_parallel=True)
    check_supported(TrainerConfig(), data_parallel=False)


def test_without_gae_there_is_no_critic(setup):
    model, batch = setup
    trainer = Trainer(model, AlgoConfig(), NO_CLIP, TrainerConfig(), critic=CriticConfig())
    assert trainer.critic is None
    assert not any(k.startswith("critic/") for k in trainer.step(batch))
