"""A trainer step with ``trainer.head_tokens=loss`` (the LM head on the loss tokens only) gives the step of
``head_tokens=all`` (today's path): gradients, metrics and the loss tokens' log-probs, in padded,
micro-batched, packed and prefix-shared layouts, with the loss terms that read log-probs or entropies.
And the step reads the device a fixed number of times, however many micro-batches it runs (issue 51)."""

import copy
import sys

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig, validate
from tidal.train.trainer import Trainer

from ..models.test_head_tokens import count_head_rows
from .test_microbatching import long_tailed_batch

LAYOUTS = [{}, {"micro_batch_tokens": 20}, {"micro_batch_tokens": 30, "packing": True, "pack_tokens": 16},
           {"share_prefixes": True, "pack_tokens": 16}, {"micro_batch_tokens": 30, "share_prefixes": True}]


@pytest.fixture(scope="module")
def batch(small_model, tokenizer):
    batch = long_tailed_batch(small_model, tokenizer)
    last = int(batch.attention_mask_bt[0].sum()) - 1
    batch.loss_mask_bt[0, last] = 0.0  # a response token the loss leaves out keeps its behaviour log-prob
    return batch


def _step(model, batch, algo, cfg, ref=None):
    model = copy.deepcopy(model)
    trainer = Trainer(model, algo, OptimConfig(lr=1e-3, grad_clip=1e9), cfg, ref_model=ref)
    metrics = trainer.step(copy.deepcopy(batch))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics, trainer.last_logp_bt


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("algo", [
    AlgoConfig(),
    AlgoConfig(policy_loss="decoupled_ppo", kl_coef=0.1, correction="tis"),
    AlgoConfig(policy_loss="sapo", entropy_coef=0.05),
    AlgoConfig(top_entropy_frac=0.5),
], ids=["grpo", "kl_tis", "sapo_entropy_bonus", "top_entropy"])
def test_loss_tokens_only_equals_every_token(small_model, batch, layout, algo):
    ref = copy.deepcopy(small_model) if algo.kl_coef > 0 else None
    full_grads, full_metrics, full_logp = _step(small_model, batch, algo, TrainerConfig(**layout), ref)
    grads, metrics, logp = _step(small_model, batch, algo, TrainerConfig(head_tokens="loss", **layout), ref)
    mask = batch.loss_mask_bt > 0
    torch.testing.assert_close(logp[mask], full_logp[mask], rtol=0, atol=1e-5)
    assert torch.equal(logp[~mask], batch.behav_logp_bt[~mask])  # outside the loss: the sampler's log-prob
    for n in full_grads:
        scale = full_grads[n].abs().max().item()
        torch.testing.assert_close(grads[n], full_grads[n], rtol=0, atol=1e-5 * scale + 1e-12, msg=n)
    assert metrics.keys() == full_metrics.keys()
    for k, v in full_metrics.items():
        if k.startswith("perf/"):  # memory peaks and sizes: what the process has, not the step's result
            continue
        assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_the_head_sees_only_the_loss_tokens_in_a_step(small_model, batch, monkeypatch):
    rows = count_head_rows(monkeypatch)
    _step(small_model, batch, AlgoConfig(), TrainerConfig(head_tokens="loss"))
    loss_tokens = int(batch.loss_mask_bt.sum())
    assert rows == [loss_tokens, loss_tokens]  # the forward, and the checkpoint's recompute in the backward
    rows.clear()
    _step(small_model, batch, AlgoConfig(), TrainerConfig())
    every = batch.num_sequences * (int(batch.attention_mask_bt.sum(-1).max()) - 1)
    assert rows == [every, every] and loss_tokens < every / 2


def test_an_unknown_head_tokens_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.head_tokens"):
        validate(TrainerConfig(head_tokens="prompt"))


def _float_reads_from_tidal(monkeypatch):
    """Counts ``.item()``, ``.tolist()``, ``float()`` and ``bool()`` of floating-point tensors called from tidal's
    own code (the trainer, the algorithms): on a GPU each is a host synchronization."""
    count = [0]
    for name in ("item", "tolist", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            if self.is_floating_point() and "/tidal/" in sys._getframe(1).f_code.co_filename:
                count[0] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


@pytest.mark.parametrize("layout", [{"micro_batch_tokens": 20}, {"micro_batch_tokens": 20, "packing": True,
                                                                  "pack_tokens": 16}])
@pytest.mark.parametrize("algo", [AlgoConfig(), AlgoConfig(kl_coef=0.1, entropy_coef=0.05)], ids=["grpo", "kl_bonus"])
def test_the_trainer_reads_the_device_a_fixed_number_of_times_per_step(small_model, batch, monkeypatch, layout,
                                                                        algo):
    """The loss and the per-token metrics (the trainer's, the policy loss's, the KL term's and the entropy
    bonus's) accumulate on the device and are read once after the micro-batches: the reads do not grow with
    their number."""
    ref = copy.deepcopy(small_model) if algo.kl_coef > 0 else None
    count = _float_reads_from_tidal(monkeypatch)
    _step(small_model, batch, algo, TrainerConfig(), ref)
    whole = count[0]
    count[0] = 0
    trainer = Trainer(copy.deepcopy(small_model), algo, OptimConfig(lr=1e-3, grad_clip=1e9), TrainerConfig(**layout),
                      ref_model=ref)
    assert len(trainer._micro_batches(batch, torch.arange(batch.num_sequences))) >= 3
    trainer.step(copy.deepcopy(batch))
    assert count[0] == whole, (count[0], whole)


@pytest.mark.parametrize("before", [False, True])
def test_a_step_leaves_the_global_tf32_setting_as_it_was(small_model, batch, before):
    """``head_matmul=tf32`` is scoped to the head's matmuls (``models/logprobs.py``'s ``tf32_matmul``); the
    step itself no longer sets PyTorch's process-wide switch."""
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = before
        _step(small_model, batch, AlgoConfig(), TrainerConfig(head_matmul="tf32"))
        assert torch.backends.cuda.matmul.allow_tf32 is before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("layout", LAYOUTS[:1] + LAYOUTS[2:4])
@pytest.mark.parametrize("head_tokens", ["all", "loss"])
@pytest.mark.parametrize("algo", [AlgoConfig(), AlgoConfig(policy_loss="sapo", entropy_coef=0.05, kl_coef=0.1)],
                         ids=["grpo", "sapo_entropy_kl"])
def test_a_step_with_the_fused_head_equals_the_chunked_one(small_model, batch, layout, head_tokens, algo,
                                                           monkeypatch):
    """``trainer.head_kernel=fused`` (``models/logprobs.py``: the closed-form backward) reaches the trainer's step
    (its backward runs: counted) with the same gradients, metrics and log-probs as ``chunked``, entropy's gradient
    included (issue 51)."""
    from tidal.models import logprobs

    backward = logprobs._FusedHead.backward
    calls = []
    monkeypatch.setattr(logprobs._FusedHead, "backward", staticmethod(lambda *a: calls.append(1) or backward(*a)))
    ref = copy.deepcopy(small_model) if algo.kl_coef > 0 else None
    want = _step(small_model, batch, algo, TrainerConfig(head_tokens=head_tokens, **layout), ref)
    assert not calls
    got = _step(small_model, batch, algo, TrainerConfig(head_tokens=head_tokens, head_kernel="fused", **layout), ref)
    assert calls, "the fused head's backward never ran: trainer.head_kernel did not reach the step"
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)
    for n in want[0]:
        scale = want[0][n].abs().max().item()
        torch.testing.assert_close(got[0][n], want[0][n], rtol=0, atol=1e-5 * scale + 1e-12, msg=n)
    for k, v in want[1].items():
        if not k.startswith("perf/"):
            assert got[1][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
