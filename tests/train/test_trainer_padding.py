"""A whole trainer step ignores what the batch holds outside its loss mask: behaviour (and teacher)
log-probs of -inf or NaN there (an engine's log-prob of a token it could not have sampled, a truncated
sample the overlong filter takes out of the loss) give the same gradients and metrics as zeros, through
the ratio, the corrections, the KL term, VCPO's ESS learning-rate scale and on-policy distillation's
advantage."""

import copy
import math

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

from . import test_microbatching

batch = test_microbatching.batch  # fixture: three groups of three, response lengths 2..9

CONFIGS = {
    "ppo_clip": {},
    "gspo+tis_sequence+rs+batch_norm": {"policy_loss": "gspo", "correction": "tis", "tis_level": "sequence",
                                        "is_batch_norm": True, "rs_stat": "seq_mean_k3", "rs_threshold": 0.5},
    "decoupled_ppo+mis+kl_k3_is": {"policy_loss": "decoupled_ppo", "correction": "mis", "mis_level": "token",
                                   "mis_low": 0.1, "mis_high": 10.0, "kl_coef": 0.1, "kl_estimator": "k3_is"},
    "sapo+ess_lr_scale": {"policy_loss": "sapo", "ess_lr_scaling": True, "advantage": "vcpo"},
    "reinforce_pp_token+kl_in_reward": {"policy_loss": "reinforce", "advantage": "reinforce_pp_token",
                                        "kl_coef": 0.05, "kl_in_reward": True, "kl_estimator": "k1"},
}


def _numbers(metrics):
    """The step's metrics that are functions of the batch (not memory or time)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("perf/", "time/"))}


def _step(model, batch, algo, ref):
    model = copy.deepcopy(model)
    trainer = Trainer(model, algo, OptimConfig(lr=1e-3, grad_clip=1e9), TrainerConfig(),
                      ref_model=copy.deepcopy(ref) if algo.kl_coef > 0 else None)
    metrics = trainer.step(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, _numbers(metrics), dict(model.named_parameters())


@pytest.mark.parametrize("padding", [-math.inf, math.nan])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_step_ignores_non_finite_padding(small_model, batch, name, padding):
    algo = AlgoConfig(**CONFIGS[name])
    ref = copy.deepcopy(small_model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    pad_bt = batch.loss_mask_bt == 0
    assert pad_bt.any() and not pad_bt.all()
    # the sampler's log-probs 0.1 off the trainer's: a real ratio, correction and KL on the response tokens
    finite = copy.copy(batch)
    finite.behav_logp_bt = batch.behav_logp_bt - 0.1 * batch.loss_mask_bt
    padded = copy.copy(finite)
    padded.behav_logp_bt = finite.behav_logp_bt.masked_fill(pad_bt, padding)
    want, want_metrics, _ = _step(small_model, finite, algo, ref)
    got, got_metrics, params = _step(small_model, padded, algo, ref)
    for n in want:
        assert torch.isfinite(got[n]).all(), f"{name}: gradient of {n} is not finite"
        torch.testing.assert_close(got[n], want[n], msg=lambda m, n=n: f"{name}: {n}: {m}")
        assert torch.isfinite(params[n]).all(), f"{name}: {n} is not finite after the step"
    assert got_metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert math.isfinite(got_metrics[k]) and got_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, v)


def test_on_policy_distillation_ignores_a_non_finite_teacher_at_padding(small_model, batch):
    algo = AlgoConfig(distill_reward_coef=0.5)
    finite = copy.copy(batch)
    finite.teacher_logp_bt = batch.behav_logp_bt - 0.3 * batch.loss_mask_bt
    padded = copy.copy(finite)
    padded.teacher_logp_bt = finite.teacher_logp_bt.masked_fill(batch.loss_mask_bt == 0, -math.inf)
    want, want_metrics, _ = _step(small_model, finite, algo, None)
    got, got_metrics, _ = _step(small_model, padded, algo, None)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=lambda m, n=n: f"{n}: {m}")
    assert {k: pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in want_metrics.items()} == got_metrics
