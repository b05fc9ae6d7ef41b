"""The block-FP8 checkpoint (tidal/models/quant_checkpoint.py, ``tidal quantize``) checked against what
vLLM 0.32's loaders expect, read off its source (``model_executor/layers/quantization/``):

- ``fp8.py`` ``Fp8LinearMethod.create_weights``: ``weight`` float8_e4m3fn [out, in] and, with
  ``weight_block_size``, ``weight_scale_inv`` float32 [ceil(out/bn), ceil(in/bk)]
  (``utils/fp8_utils.py`` ``create_fp8_scale_parameter``); ``Fp8Config.from_config`` reads
  ``quant_method`` (must contain "fp8"), ``activation_scheme`` (must be "dynamic" with blocks) and
  ``weight_block_size`` (two numbers).
- ``compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py``: the same weight, the scale named
  ``weight_scale``; ``compressed_tensors.py`` ``_is_fp8_w8a8`` wants float weights and activations,
  symmetric static weights with strategy tensor/channel/block, and dynamic activations.
- ``utils/fp8_utils.py`` ``validate_fp8_block_shape``: fused shards (q/k of qkv, gate of gate_up)
  must be whole multiples of the block's rows.

The vLLM-venv test in tests/rollout/test_vllm_quant.py checks the same files with vLLM's own code.
"""

import json
import math

import pytest
import torch
from safetensors import safe_open

from tidal.cli import main
from tidal.models import tiny
from tidal.models.quant import fp8_error_bound, linear_weight_names, quantize_fp8_block
from tidal.models.quant_checkpoint import load_dequantized, quantization_config, quantize_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A one-layer tiny model whose fused shards fill whole 128-row tiles (as the quickstart's do)."""
    cfg = tiny.ModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=256)
    path = tmp_path_factory.mktemp("fp32")
    tiny.save(tiny.build_model(cfg, tokenizer), tokenizer, path)
    return path


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("layout,scale_name", [("compressed-tensors", "weight_scale"), ("fp8", "weight_scale_inv")])
def test_checkpoint_tensors_match_vllm_block_fp8(model_dir, tmp_path, layout, scale_name):
    info = quantize_checkpoint(model_dir, tmp_path, layout)
    model, _ = tiny.load(model_dir)
    src = model.state_dict()
    names = linear_weight_names(model)
    assert info["num_quantized"] == len(names) == 7  # q, k, v, o, gate, up, down
    out = _tensors(tmp_path)
    scales = {n.removesuffix("weight") + scale_name for n in names}
    # Tied embeddings: the head is the embedding and is not written (as save_pretrained does).
    assert set(out) == (set(src) - {"lm_head.weight"}) | scales
    for n in names:
        rows, cols = src[n].shape
        assert out[n].dtype == torch.float8_e4m3fn and out[n].shape == (rows, cols)
        scale = out[n.removesuffix("weight") + scale_name]
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(rows / 128), math.ceil(cols / 128))
        assert torch.equal(scale, quantize_fp8_block(src[n])[1])
    for n in set(src) - set(names) - {"lm_head.weight"}:  # embeddings and norms: untouched
        assert out[n].dtype == src[n].dtype and torch.equal(out[n], src[n])
    deq = load_dequantized(tmp_path)
    for n in names:
        assert ((deq[n] - src[n]).abs() <= fp8_error_bound(src[n], out[n.removesuffix("weight") + scale_name])
                * (1 + 1e-6)).all()
    assert info["bytes_after"] < 0.3 * info["bytes_before"]  # ~1 byte per weight instead of 4
    tok = tiny.load_tokenizer(tmp_path)  # the tokenizer files came along
    assert tok("1 + 2 =\n").input_ids == tiny.build_tokenizer()("1 + 2 =\n").input_ids


def test_compressed_tensors_config_keys(model_dir, tmp_path):
    quantize_checkpoint(model_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2"  # the rest of the config is kept
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "float-quantized"
    assert q["quantization_status"] == "compressed" and q["ignore"] == ["lm_head"]
    (group,) = q["config_groups"].values()
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["strategy"], w["block_structure"], w["symmetric"], w["dynamic"]) == \
        (8, "float", "block", [128, 128], True, False)
    assert (a["num_bits"], a["type"], a["strategy"], a["group_size"], a["symmetric"], a["dynamic"]) == \
        (8, "float", "group", 128, True, True)


def test_fp8_config_keys():
    assert quantization_config("fp8") == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    with pytest.raises(ValueError, match="layout='nvfp4'"):
        quantization_config("nvfp4")


def test_refuses_shards_vllm_cannot_fuse(small_model, tokenizer, tmp_path):
    tiny.save(small_model, tokenizer, tmp_path / "in")  # hidden 64: q_proj has 64 rows, half a tile
    with pytest.raises(ValueError, match=r"q_proj.weight has 64 output rows, not a multiple of 128"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out")


def test_cli_quantize(model_dir, tmp_path, capsys):
    assert main(["quantize", str(model_dir), str(tmp_path / "q"), "--layout", "fp8"]) == 0
    assert "7 linear weights to FP8" in capsys.readouterr().out
    assert json.loads((tmp_path / "q/config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "q2")]) == 2
    assert "config.json missing" in capsys.readouterr().err


def test_cli_quantize_never_writes_over_its_source(model_dir, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    for dst in (model_dir, model_dir / ".." / model_dir.name):
        assert main(["quantize", str(model_dir), str(dst)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is the source model directory" in err[0]
    (tmp_path / "f").write_text("mine")
    assert main(["quantize", str(model_dir), str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "f").read_text() == "mine"
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    assert main(["quantize", str(model_dir), str(tmp_path / "q")]) == 0  # files land under their names only
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == sorted(
        n for n in before if n in ("config.json", "model.safetensors", "generation_config.json") or "token" in n)


@pytest.mark.parametrize("layout,package", [("compressed-tensors", "compressed_tensors"), ("fp8", "accelerate")])
def test_cli_eval_of_a_quantized_checkpoint_without_its_package_names_the_extra(model_dir, tmp_path, capsys, layout,
                                                                                 package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed: the checkpoint loads")
    quantize_checkpoint(model_dir, tmp_path / "q", layout)
    assert main(["eval", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"quant_method {layout.split('-')[0]}" in err[0] and "pip install 'tidal[quant]'" in err[0]
