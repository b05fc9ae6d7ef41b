"""The trainer's head on CUDA (``-m gpu``; skipped without CUDA), issue 51: ``trainer.head_tokens=loss`` gives
the ``all`` step's log-probs, loss and gradients under bf16 autocast, and ``trainer.head_matmul=tf32`` turns
TF32 on for the head's matmuls only. The CPU proofs are ``tests/models/test_head_tokens.py`` and
``tests/train/test_trainer_head_tokens.py``; this is what the device check confirms before ``loss`` becomes
the default. Also: AdamW is fused on CUDA, and the syncs per step are counted. Measured gaps go to
``$TIDAL_GPU_REPORT``."""

import copy
import warnings

import pytest
import torch

from tests.gpu.test_cuda import LAYOUTS, _batch, report
from tests.train.test_precision import grads_of_step
from tidal.algo.config import AlgoConfig
from tidal.models import logprobs
from tidal.optim import OptimConfig, build_optimizer
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("head_matmul", ["fp32", "tf32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_tokens_only_equals_every_token_in_bf16_on_cuda(small_model, tokenizer, layout, head_matmul):
    """Same batch, same weights, bf16 autocast on CUDA: the loss tokens' log-probs within 1e-4, the loss within
    1e-5 relative, gradient cosine >= 0.99999 (the two heads' GEMMs have other shapes, and may round apart)."""
    batch = _batch(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)), tokenizer)
    results = {}
    for tokens in ("all", "loss"):
        cfg = TrainerConfig(precision="bf16", head_matmul=head_matmul, head_tokens=tokens, **LAYOUTS[layout])
        trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), cfg, device="cuda")
        metrics, grads = grads_of_step(trainer, batch)
        results[tokens] = metrics, grads, trainer.last_logp_bt.cpu()
    (m_all, g_all, lp_all), (m_loss, g_loss, lp_loss) = results["all"], results["loss"]
    mask = batch.loss_mask_bt.bool()
    gap = (lp_all - lp_loss).abs()[mask]
    cosine = torch.nn.functional.cosine_similarity(g_all, g_loss, dim=0).item()
    report("head_tokens_loss_vs_all_cuda_bf16", layout=layout, head_matmul=head_matmul, grad_cosine=cosine,
           logp_gap_max=gap.max().item(), loss_all=m_all["train/loss"], loss_loss=m_loss["train/loss"],
           bit_equal_logp=bool(torch.equal(lp_all[mask], lp_loss[mask])),
           bit_equal_grads=bool(torch.equal(g_all, g_loss)))
    assert gap.max() <= 1e-4, gap.max()
    assert m_loss["train/loss"] == pytest.approx(m_all["train/loss"], rel=1e-5, abs=1e-7)
    assert cosine >= 0.99999, cosine


def test_tf32_is_on_inside_the_head_only(small_model, tokenizer, monkeypatch):
    """With ``head_matmul=tf32`` the decoder's forward and backward see TF32 off, the head's matmuls see it on,
    and the process-wide setting is off again after the step."""
    batch = _batch(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)), tokenizer)
    seen = {"body": set(), "head": set()}
    real = logprobs.tf32_matmul

    def spy(enabled=True):
        cm = real(enabled)

        class Wrapped:
            def __enter__(self):
                cm.__enter__()
                seen["head"].add(torch.backends.cuda.matmul.allow_tf32)

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Wrapped()

    monkeypatch.setattr(logprobs, "tf32_matmul", spy)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3),
                          TrainerConfig(precision="bf16", head_matmul="tf32"), device="cuda")
        layer = trainer.model.get_decoder().layers[0]
        layer.register_forward_hook(lambda *_: seen["body"].add(torch.backends.cuda.matmul.allow_tf32))
        layer.register_full_backward_hook(lambda *_: seen["body"].add(torch.backends.cuda.matmul.allow_tf32))
        trainer.step(batch)
        assert seen == {"body": {False}, "head": {True}}, seen
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_host_synchronizations_per_step(small_model, tokenizer):
    """How many synchronizing CUDA calls a step makes, one micro-batch against several (reported for the device
    check; on CPU ``tests/train/test_trainer_head_tokens.py`` shows tidal's own reads do not grow with
    micro-batches on the default loss; what remains here is PyTorch's and the layout uploads')."""
    batch = _batch(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)), tokenizer)
    counts = {}
    for name, extra in (("one", {}), ("several", {"micro_batch_tokens": 200})):
        trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3),
                          TrainerConfig(precision="bf16", **extra), device="cuda")
        trainer.step(batch)  # warm-up
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in caught)
        counts[f"{name}_micro_batches"] = len(trainer._micro_batches(batch, torch.arange(batch.num_sequences)))
    report("trainer_syncs_per_step", **counts)
    assert counts["several_micro_batches"] > counts["one_micro_batches"]


def test_the_trainer_s_adamw_is_fused_on_cuda(small_model):
    """``optim.adamw_kernel``: every parameter on CUDA, so the fused kernel; weights and state stay float32."""
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(), device="cuda")
    assert trainer.optimizer.param_groups[0]["fused"] is True
    opt, _ = build_optimizer(torch.nn.Linear(4, 4).cuda(), OptimConfig())
    assert opt.param_groups[0]["fused"] is True
