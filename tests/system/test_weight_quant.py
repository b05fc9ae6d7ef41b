"""``rollout.weight_quant=fp8_block``: the trainer ships e4m3 weights + block scales (and counts those
bytes), the local engine samples with the dequantized weights, the trainer keeps full precision, and
the engine/trainer log-prob gap shows up in ``train/logp_mismatch_mean``."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.api import GenRequest
from tidal.config import ConfigError
from tidal.models.logprobs import token_logprobs
from tidal.models.quant import dequantize_state_dict, linear_weight_names
from tidal.models.tied import retie, tied_names
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.system.run import prepare
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Prompt

from .test_controller import run, tiny_cfg


def _nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


def test_trainer_ships_fp8_and_counts_its_bytes(small_model):
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig())
    full = trainer.state_dict_for_engine()
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == _nbytes(full)
    packed = trainer.state_dict_for_engine("fp8_block")
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == _nbytes(packed)
    names = linear_weight_names(trainer.model)
    linear_fp32 = sum(full[n].numel() * 4 for n in names)
    scales = sum(packed[n.removesuffix("weight") + "weight_scale"].numel() * 4 for n in names)
    assert _nbytes(full) - _nbytes(packed) == linear_fp32 * 3 // 4 - scales  # 4 -> 1 byte, plus scales
    assert all(trainer.model.state_dict()[n].dtype == torch.float32 for n in names)  # the trainer is untouched
    with pytest.raises(ValueError, match="rollout.weight_quant='int4'"):
        trainer.state_dict_for_engine("int4")


def test_local_engine_samples_with_the_dequantized_weights(small_model, tokenizer):
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig())
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=6))
    engine.request_weight_update(trainer.state_dict_for_engine("fp8_block"), 1)
    prompts = [Prompt(f"p{i}", f"{i}+{i + 3}=", "") for i in range(8)]
    reqs = [GenRequest(p, tokenizer(p.text).input_ids, k) for p in prompts for k in range(2)]
    trajs = engine.generate(reqs)
    assert engine.version == 1 and all(set(t.versions) == {1} for t in trajs)
    dequantized = retie(dequantize_state_dict(trainer.state_dict_for_engine("fp8_block")), tied_names(trainer.model))
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, dequantized[name]), name
    gaps_deq, gaps_full = [], []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.token_ids])
            sl = slice(len(t.prompt_ids), ids.shape[1])
            engine_logp = torch.tensor(t.logprobs)
            gaps_deq.append((token_logprobs(engine.model, ids, None)[0][0, sl] - engine_logp).abs().max())
            gaps_full.append((token_logprobs(trainer.model, ids, None)[0][0, sl] - engine_logp).abs().max())
    assert max(gaps_deq) < 1e-4  # the engine's log-probs are the quantized model's
    assert max(gaps_full) > 1e-3  # ... which is not the trainer's: the gap the correction absorbs


def test_run_with_fp8_rollouts(tmp_path):
    _, plain = run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=3"), tmp_path / "plain")
    controller, quant = run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=3", "rollout.weight_quant=fp8_block"),
                            tmp_path / "quant")
    assert quant.history[-1]["perf/weight_sync_bytes"] < 0.5 * plain.history[-1]["perf/weight_sync_bytes"]
    # Steps whose batch had a learning signal report the gap on the tokens of the current version.
    gap = lambda r: [h["train/logp_mismatch_mean"] for h in r.history if "train/logp_mismatch_mean" in h]  # noqa: E731
    assert len(gap(plain)) >= 2 and len(gap(quant)) >= 2
    assert max(gap(plain)) < 1e-5 < 1e-4 < min(gap(quant))  # float32 engine: exact; FP8 weights: not
    # Version 0 was sampled with quantized weights too (the engine starts from the quantized copy).
    assert "train/logp_mismatch_mean" in quant.history[1] and quant.history[1]["train/logp_mismatch_mean"] > 1e-4
    assert controller.trainer.model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_vllm_engine_refuses_fp8_rollouts(tmp_path):
    cfg = tiny_cfg(tmp_path, "rollout.weight_quant=fp8_block", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match="rollout.weight_quant=fp8_block needs rollout.engine=local"):
        prepare(cfg, tmp_path / "run")


def test_unknown_weight_quant_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="weight_quant"):
        tiny_cfg(tmp_path, "rollout.weight_quant=int3")


@pytest.mark.slow  # a Ray worker imports torch and transformers: ~20 s here
def test_ray_workers_sample_with_the_same_fp8_weights(local_ray, tmp_path):
    """Ray's object store carries the e4m3 tensors as raw bytes (``ray_engine.to_arrays``); the
    workers' local engines dequantize them: the same gaps as the local backend, step by step."""
    from tidal.system.run import close

    quant = ("system.mode=async", "rollout.max_staleness=0", "max_steps=3", "rollout.weight_quant=fp8_block")
    _, local = run(tiny_cfg(tmp_path, *quant), tmp_path / "local")
    controller = prepare(tiny_cfg(tmp_path, *quant, "system.backend=ray", "system.rollout_workers=1",
                                  "reward.num_workers=0"), tmp_path / "ray")
    try:
        ray = controller.run()
    finally:
        close(controller)
    gaps = [[h.get("train/logp_mismatch_mean") for h in r.history[1:]] for r in (local, ray)]
    assert any(g is not None and g > 1e-4 for g in gaps[1])
    assert gaps[0] == pytest.approx(gaps[1], abs=1e-5)
    assert ray.history[-1]["perf/weight_sync_bytes"] == local.history[-1]["perf/weight_sync_bytes"]
