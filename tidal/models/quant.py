"""Block quantization of weights (FP8 e4m3 and INT4) and the Hadamard rotation, as pure functions.

**FP8 block** (DeepSeek-V3, arXiv 2412.19437, sec. 3.3.2): a weight matrix is cut into 128 x 128
tiles; each tile gets one float32 scale ``s = amax(|tile|) / 448`` (448 is the largest finite
e4m3 value) and its entries are stored as ``e4m3(w / s)``. No calibration data: the scale is the
tile's own absolute maximum. Dequantization is ``q * s``, so an outlier only coarsens its own tile.
Tiles at the right and bottom edges are partial: the scale grid is ``ceil(rows/128) x
ceil(cols/128)``. e4m3 has 3 mantissa bits, so round-to-nearest leaves a relative error of at most
2^-4 on normal values (|w/s| >= 2^-6); below that, values are subnormal with spacing 2^-9, i.e. an
absolute error of at most 2^-10 * s (``fp8_error_bound``). torch's CPU float8 cast does not
saturate, so values are clamped to +-448 first (FACTS.md).

**INT4 block** (group-wise, as GPTQ/AWQ's "g128": 1 x 128 groups along the input dimension):
``s = amax / 7``, ``q = round(w / s)`` in [-7, 7], error at most ``s / 2``. Stored unpacked in int8
here: it is a study format (``benchmarks/quant.py``), not a wire format.

**Hadamard rotation** (QuaRot arXiv 2404.00456, sec. 3; QuIP# arXiv 2402.04396): ``W' = W R`` with
R an orthogonal, randomized Hadamard matrix (Sylvester's construction, columns multiplied by random
signs, scaled by 1/sqrt(n)) spreads an outlier of one input channel over n channels, so a group's
absmax, and with it the step of every other entry, shrinks. Exactness needs the activations
rotated by R^T too; ``fake_quantize`` instead un-rotates after dequantizing, so the rotation only
changes the quantization error. R here is block-diagonal with blocks of ``gcd(cols, 128)`` (a power
of two, so it always exists, and it matches the quantization tile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (OCP FP8 spec); DeepSeek-V3 maps each tile's absmax to it."""
E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal e4m3 value; below it the spacing is the subnormal step 2^-9."""
INT4_MAX = 7
"""Symmetric INT4: absmax maps to 7, so every value fits in [-7, 7] without clipping."""
FP8_BLOCK = (128, 128)
"""DeepSeek-V3's weight tile (rows x cols); vLLM's CPU/GPU block kernels require 128 along K."""
INT4_BLOCK = (1, 128)
"""Group-wise INT4: 128 input channels of one output row share a scale (GPTQ/AWQ g128)."""
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
"""Names a block scale travels under: compressed-tensors' ``weight_scale``, DeepSeek/vLLM-fp8's
``weight_scale_inv`` (both are multipliers: w ~ q * scale)."""


def _tiles(w_rc: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` zero-padded to whole tiles and viewed as [row_tiles, block_rows, col_tiles, block_cols]."""
    rows, cols = w_rc.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.nn.functional.pad(w_rc.float(), (0, nc * bc - cols, 0, nr * br - rows))
    return padded.view(nr, br, nc, bc)


def _expand(scale_rc: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """One scale per tile, repeated over the tile's entries and cropped to ``shape``."""
    full = scale_rc.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def block_scales(w_rc: torch.Tensor, qmax: float, block: tuple[int, int]) -> torch.Tensor:
    """Per-tile ``amax / qmax`` (float32, shape ceil(rows/br) x ceil(cols/bc)); 1 for an all-zero
    tile, which then dequantizes to exact zeros (any scale would)."""
    amax = _tiles(w_rc, block).abs().amax(dim=(1, 3))
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_fp8_block(w_rc: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weights of w's shape, float32 scales [ceil(rows/br), ceil(cols/bc)]): w ~ q * scale."""
    assert w_rc.dim() == 2, f"block quantization takes a matrix, got shape {tuple(w_rc.shape)}"
    scale = block_scales(w_rc, E4M3_MAX, block)
    scaled = w_rc.float() / _expand(scale, w_rc.shape, block)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_block(q_rc: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` tile by tile (q may be float8 or int8), in ``dtype``."""
    return (q_rc.float() * _expand(scale.float(), q_rc.shape, block)).to(dtype)


def fp8_error_bound(w_rc: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Per-entry bound on |w - dequantize(quantize(w))|: half an e4m3 step at w's magnitude, i.e.
    2^-4 |w| for normals and 2^-10 * scale for subnormals (|w / scale| < 2^-6)."""
    return torch.maximum(w_rc.float().abs() * 2.0**-4, _expand(scale, w_rc.shape, block) * 2.0**-10)


def quantize_int4_block(w_rc: torch.Tensor, block: tuple[int, int] = INT4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 holding values in [-7, 7], float32 scales): symmetric absmax INT4, w ~ q * scale."""
    assert w_rc.dim() == 2, f"block quantization takes a matrix, got shape {tuple(w_rc.shape)}"
    scale = block_scales(w_rc, INT4_MAX, block)
    q = torch.round(w_rc.float() / _expand(scale, w_rc.shape, block)).clamp(-INT4_MAX, INT4_MAX)
    return q.to(torch.int8), scale


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix scaled by 1/sqrt(n) (orthogonal); n a power of two."""
    assert n > 0 and n & (n - 1) == 0, f"Sylvester's construction needs a power of two, got {n}"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotation_size(cols: int, block: int = FP8_BLOCK[1]) -> int:
    """Side of the block-diagonal Hadamard for ``cols`` input channels: gcd(cols, 128)."""
    return math.gcd(cols, block)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """QuaRot's randomized Hadamard: H diag(s) with random signs s (still orthogonal)."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return hadamard(n) * signs


def rotate(w_rc: torch.Tensor, r_hh: torch.Tensor) -> torch.Tensor:
    """``w @ blockdiag(r, r, ...)``: each run of h input channels multiplied by r (h x h)."""
    rows, cols = w_rc.shape
    h = r_hh.shape[0]
    assert cols % h == 0, f"{cols} input channels are not a multiple of the rotation size {h}"
    return (w_rc.float().view(rows, cols // h, h) @ r_hh).view(rows, cols)


def fake_quantize(w_rc: torch.Tensor, fmt: str, rotation: bool = False, seed: int = 0) -> torch.Tensor:
    """dequantize(quantize(w)) in ``fmt`` (``fp8_block`` or ``int4_block``), optionally through a
    randomized Hadamard rotation that is undone afterwards (only the quantization error changes)."""
    r = random_hadamard(rotation_size(w_rc.shape[1]), seed) if rotation else None
    x = rotate(w_rc, r) if r is not None else w_rc.float()
    if fmt == "fp8_block":
        x = dequantize_block(*quantize_fp8_block(x), FP8_BLOCK)
    elif fmt == "int4_block":
        x = dequantize_block(*quantize_int4_block(x), INT4_BLOCK)
    else:
        raise ValueError(f"unknown quantization format {fmt!r} (fp8_block, int4_block)")
    return (rotate(x, r.T) if r is not None else x).to(w_rc.dtype)


# ---- state dicts ---------------------------------------------------------------------------------
def linear_weight_names(model: torch.nn.Module, skip: Iterable[str] = ("lm_head",)) -> list[str]:
    """State-dict names of the ``nn.Linear`` weights to quantize: every linear layer except ``skip``
    (the LM head stays full precision, as in DeepSeek-V3 and compressed-tensors' FP8_BLOCK recipes;
    embeddings and norms are not linear layers and stay as they are)."""
    skip = set(skip)
    return [f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.split(".")[-1] not in skip]


def quantize_state_dict(sd: Mapping[str, torch.Tensor], names: Iterable[str],
                        scale_suffix: str = "weight_scale") -> dict[str, torch.Tensor]:
    """``sd`` with each weight in ``names`` replaced by its FP8 block form plus a ``scale_suffix``
    entry next to it (``a.b.weight`` -> ``a.b.weight`` (e4m3) and ``a.b.weight_scale`` (float32))."""
    assert scale_suffix in SCALE_SUFFIXES, f"scale_suffix={scale_suffix!r}: use one of {SCALE_SUFFIXES}"
    out = dict(sd)
    for name in names:
        out[name], out[name.removesuffix("weight") + scale_suffix] = quantize_fp8_block(sd[name])
    return out


def dequantize_state_dict(sd: Mapping[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inverse of ``quantize_state_dict``: every float8 weight with a scale next to it becomes a
    ``dtype`` tensor and the scale entry is dropped. A state dict without scales comes back as is."""
    out = dict(sd)
    for key, scale in sd.items():
        prefix, _, suffix = key.rpartition(".")
        if suffix in SCALE_SUFFIXES:
            weight = f"{prefix}.weight" if prefix else "weight"
            assert sd[weight].dtype == torch.float8_e4m3fn, f"{key} scales {weight}, which is {sd[weight].dtype}"
            out[weight] = dequantize_block(sd[weight], scale, FP8_BLOCK, dtype)
            del out[key]
    return out
