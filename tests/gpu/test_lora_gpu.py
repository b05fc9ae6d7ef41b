"""LoRA and QLoRA on one CUDA GPU (``-m gpu``; ``scripts/device_check.sh`` runs them on a borrowed machine,
they cannot run on the CPU-only CI). QLoRA's 4-bit base needs bitsandbytes (carried in .whl/ by
``scripts/device_wheels.txt``); without it that test is skipped, saying so."""

import pytest
import torch

from tests.gpu.test_cuda import report
from tests.system.test_controller import run, tiny_cfg
from tidal.models import lora
from tidal.models.logprobs import token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("peft", reason="needs peft")
LORA = ("system.device=cuda", "system.mode=sync", "model.lora.rank=4", "optim.lr=5e-2")


def _engine_matches_trainer(c, atol: float) -> float:
    """The engine after the last adapter sync against the trainer's log-probs (bf16 engine: ``atol``)."""
    assert c.engine._apply_pending_update() and c.engine.version == c.trainer.version
    ids = torch.randint(3, 40, (4, 12), device="cuda")
    with torch.no_grad(), c.trainer.autocast():
        want = token_logprobs(c.trainer.model, ids, None)[0]
    got = token_logprobs(c.engine.model, ids, None)[0].float()
    gap = (got - want).abs().max().item()
    assert gap < atol, gap
    return gap


def test_lora_run_on_cuda_sends_adapters_and_the_engine_follows(tmp_path):
    c, result = run(tiny_cfg(tmp_path, *LORA), tmp_path / "run")
    rows = [r for r in result.history if "perf/weight_sync_bytes" in r]
    full = sum(p.numel() * 2 for p in c.trainer.model.get_base_model().parameters())  # bf16 engine
    assert rows and max(r["perf/weight_sync_bytes"] for r in rows) < full / 5
    assert any(r.get("train/grad_norm", 0) > 0 for r in result.history)
    gap = _engine_matches_trainer(c, atol=0.1)  # bf16 engine vs bf16-autocast trainer
    report("lora_cuda", engine_trainer_max_gap=gap, sync_bytes=rows[-1]["perf/weight_sync_bytes"])


def test_qlora_trains_on_a_4bit_base_and_resumes(tmp_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (scripts/device_wheels.txt)")
    opts = (*LORA, "model.lora.quantize=4bit", "max_steps=2")
    c, result = run(tiny_cfg(tmp_path, *opts), tmp_path / "q")
    kinds = {type(layer.base_layer).__name__ for _, layer in lora._lora_layers(c.trainer.model)}
    assert kinds == {"Linear4bit"}, kinds
    params = c.trainer.model.named_parameters()
    assert all(p.requires_grad == ("lora_" in n) for n, p in params if p.is_floating_point())
    assert any(r.get("train/grad_norm", 0) > 0 for r in result.history)
    gap = _engine_matches_trainer(c, atol=0.25)  # the engine samples from the dequantized NF4 base, in bf16
    c2, _ = run(tiny_cfg(tmp_path, *LORA, "model.lora.quantize=4bit", "max_steps=3"), tmp_path / "q", resume=True)
    assert c2.trainer.version == 3
    report("qlora_cuda", engine_trainer_max_gap=gap, peak_mem_gb=result.history[-1].get("perf/peak_mem_gb"))
