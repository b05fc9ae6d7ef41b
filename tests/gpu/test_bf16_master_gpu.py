"""``trainer.weights=bf16_master`` on CUDA (``-m gpu``; skipped without CUDA), issue 51: the CPU proofs of
``tests/train/test_bf16_master.py`` where the kernels differ (cuBLAS bf16 GEMMs, fused AdamW, SDPA/flex
attention in bf16). Measured gaps go to ``$TIDAL_GPU_REPORT``. Its speed is ``tidal bench gpu --set
'parts=[train,train_bf16_master]'``."""

import copy

import pytest
import torch

from tests.gpu.test_cuda import LAYOUTS, _batch, report
from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig, adamw_kernel
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_step_is_fused_adamw_on_the_masters_and_tracks_autocast(small_model, tokenizer, layout):
    """One step: the masters equal fused AdamW on float32 copies with the captured float32 gradients (bit for
    bit), the bf16 parameters are the masters rounded. Three steps: the loss within 1e-3 of bf16 autocast's and
    the update direction at cosine > 0.99 (the CPU test's bounds)."""
    batch = _batch(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)), tokenizer)
    cfg = TrainerConfig(weights="bf16_master", micro_batch_tokens=96, **LAYOUTS[layout])
    master = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), cfg, device="cuda")
    auto_cfg = TrainerConfig(precision="bf16", micro_batch_tokens=96, **LAYOUTS[layout])
    auto = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), auto_cfg, device="cuda")
    before = [m.detach().clone() for m in master.weights.masters]
    grads = []

    class Capture:
        def after_backward(self):
            grads.append([m.grad.detach().clone() for m in master.weights.masters])

        def after_optimizer(self):
            pass

    master.observers.append(Capture())
    losses = []
    for step in range(3):
        m_master, m_auto = master.step(batch), auto.step(batch)
        losses.append((m_master["train/loss"], m_auto["train/loss"]))
        if step == 0:
            ref = [torch.nn.Parameter(b.clone()) for b in before]
            for r, g in zip(ref, grads[0]):
                r.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ref, master.optim_cfg.grad_clip)
            o = master.optim_cfg
            torch.optim.AdamW(ref, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                              **adamw_kernel(ref)).step()
            exact = all(torch.equal(m, r.detach()) for m, r in zip(master.weights.masters, ref))
            report("bf16_master_step_is_adamw_cuda", layout=layout, bit_equal=exact)
            assert exact
    for p, m in zip(master.weights.params, master.weights.masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.detach().to(torch.bfloat16))

    def update(params):
        return torch.cat([(p.detach().float().cpu() - s.detach()).flatten()
                          for p, s in zip(params, small_model.parameters())])

    cosine = torch.nn.functional.cosine_similarity(update(master.weights.masters), update(auto.model.parameters()),
                                                   dim=0).item()
    report("bf16_master_vs_autocast_cuda", layout=layout, losses=losses, update_cosine=cosine,
           peak_mem_gb_master=m_master.get("perf/peak_mem_gb"), peak_mem_gb_autocast=m_auto.get("perf/peak_mem_gb"))
    assert all(abs(a - b) < 1e-3 for a, b in losses), losses
    assert cosine > 0.99, cosine
