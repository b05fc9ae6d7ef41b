"""Write a Hugging Face checkpoint with block-FP8 weights in a layout vLLM loads (``tidal quantize``).

Two layouts carry the same tensors (each linear weight as float8_e4m3fn, one float32 scale per
128 x 128 tile, scale shape ceil(rows/128) x ceil(cols/128), w ~ weight * scale); they differ in the
scale's name and in ``config.json``'s ``quantization_config``. Both were read off vLLM 0.32's
loaders (``model_executor/layers/quantization/``):

- ``compressed-tensors`` (default; llm-compressor's ``FP8_BLOCK`` preset, compressed-tensors 0.17
  ``quantization/quant_scheme.py``): scale tensor ``<layer>.weight_scale``; config
  ``quant_method: compressed-tensors``, ``format: float-quantized``, one config group targeting
  ``Linear`` with weights ``{num_bits: 8, type: float, strategy: block, block_structure: [128, 128],
  symmetric, static}`` and input activations ``{num_bits: 8, type: float, strategy: group,
  group_size: 128, symmetric, dynamic}``; ``ignore: [lm_head]``. vLLM's ``CompressedTensorsW8A8Fp8``
  registers the scale as ``weight_scale``.
- ``fp8`` (DeepSeek-V3 / Qwen3-FP8 native): scale tensor ``<layer>.weight_scale_inv``; config
  ``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme: dynamic`` (the only scheme vLLM's
  ``Fp8Config`` accepts with blocks), ``weight_block_size: [128, 128]``. The "inv" is historical:
  it is the dequantization multiplier, the same number as compressed-tensors' ``weight_scale``.

Everything that is not a linear weight (embeddings, norms, biases, a tied head) is written as is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tidal.models.quant import FP8_BLOCK, linear_weight_names, quantize_state_dict
from tidal.models.tiny import load

LAYOUTS = ("compressed-tensors", "fp8")
SCALE_NAME = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv"}
WEIGHTS_FILE = "model.safetensors"
SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "chat_template*",
              "generation_config.json")
"""Copied next to the weights (a training checkpoint's optimizer and RNG state are not)."""


def quantization_config(layout: str) -> dict:
    """``config.json``'s ``quantization_config`` for ``layout`` (see the module docstring)."""
    block = list(FP8_BLOCK)
    if layout == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block,
                "modules_to_not_convert": ["lm_head"]}
    if layout == "compressed-tensors":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "block", "block_structure": block, "dynamic": False},
                "input_activations": {**fp8, "strategy": "group", "group_size": block[1], "dynamic": True},
                "output_activations": None,
            }},
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
        }
    raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")


MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections vLLM fuses into one layer (``qkv_proj``, ``gate_up_proj``); the block scales
of every shard but the last must start on a tile boundary (vLLM's ``validate_fp8_block_shape``)."""


def check_vllm_tiles(sd: dict[str, torch.Tensor], names: list[str], block_rows: int = FP8_BLOCK[0]) -> None:
    """Raise if vLLM could not load these block scales: a fused shard other than the last whose
    output rows are not a multiple of the tile (its scales would straddle its neighbour's)."""
    for name in names:
        module, _, _ = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        for group in MERGED:
            if proj in group[:-1] and sd[name].shape[0] % block_rows:
                raise ValueError(f"{name} has {sd[name].shape[0]} output rows, not a multiple of {block_rows}: vLLM "
                                 f"fuses {parent}.{{{','.join(group)}}} and needs every shard but the last to fill "
                                 "whole tiles")


def quantize_checkpoint(src: str | Path, dst: str | Path, layout: str = "compressed-tensors") -> dict[str, int]:
    """Read the model in ``src``, write its block-FP8 checkpoint to ``dst`` (weights, config with
    ``quantization_config``, tokenizer and other side files); return byte counts before and after."""
    src, dst = Path(src), Path(dst)
    quant = quantization_config(layout)  # validates layout before any work
    if dst.exists() and (not dst.is_dir() or src.samefile(dst)) or dst.resolve() == src.resolve():
        what = "is the source model directory" if dst.is_dir() or not dst.exists() else "is a file"
        raise ValueError(f"output {dst} {what} (source {src}); choose a new directory for the FP8 copy")
    model, _ = load(src)
    config = json.loads((src / "config.json").read_text())
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # the embedding is the head (save_pretrained does the same)
    names = linear_weight_names(model)
    check_vllm_tiles(sd, names)
    out = quantize_state_dict(sd, names, SCALE_NAME[layout])
    dst.mkdir(parents=True, exist_ok=True)
    # every file goes to a temporary name first and is renamed only once all are written: an
    # interrupted run never leaves a checkpoint whose config.json promises weights that are not there
    tmp = {name: dst / f"{name}.tmp" for name in
           [f.name for pattern in SIDE_FILES for f in src.glob(pattern)] + [WEIGHTS_FILE, "config.json"]}
    try:
        for name in tmp:
            if (src / name).exists() and name not in (WEIGHTS_FILE, "config.json"):
                shutil.copy2(src / name, tmp[name])
        save_file(out, str(tmp[WEIGHTS_FILE]), metadata={"format": "pt"})
        tmp["config.json"].write_text(json.dumps({**config, "quantization_config": quant}, indent=2) + "\n")
        for name, path in tmp.items():
            path.replace(dst / name)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    nbytes = lambda d: sum(t.numel() * t.element_size() for t in d.values())  # noqa: E731
    return {"num_quantized": len(names), "bytes_before": nbytes(sd), "bytes_after": nbytes(out)}


def load_dequantized(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint written by ``quantize_checkpoint``, dequantized to ``dtype``."""
    from safetensors.torch import load_file

    from tidal.models.quant import dequantize_state_dict

    return dequantize_state_dict(load_file(str(Path(path) / WEIGHTS_FILE)), dtype)
