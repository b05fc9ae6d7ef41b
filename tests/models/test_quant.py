"""Block quantization (tidal/models/quant.py): hand-computed values, the e4m3 error bound per tile,
outlier isolation, the Hadamard rotation, and state-dict round trips."""

import math

import pytest
import torch

from tidal.models.quant import (
    E4M3_MAX,
    FP8_BLOCK,
    INT4_BLOCK,
    dequantize_block,
    dequantize_state_dict,
    fake_quantize,
    fp8_error_bound,
    hadamard,
    linear_weight_names,
    quantize_fp8_block,
    quantize_int4_block,
    quantize_state_dict,
    random_hadamard,
    rotate,
    rotation_size,
)


def _per_tile(x: torch.Tensor, block=FP8_BLOCK) -> list[torch.Tensor]:
    return [x[i:i + block[0], j:j + block[1]] for i in range(0, x.shape[0], block[0])
            for j in range(0, x.shape[1], block[1])]


def test_fp8_hand_computed_values():
    # Tile 0 has absmax 448 -> scale 1; tile 1 has absmax 896 -> scale 2 (DeepSeek-V3: amax / 448).
    w = torch.zeros(2, 256)
    w[0, 0], w[1, 1] = 448.0, 0.3
    w[0, 128], w[1, 129] = -896.0, 0.6
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == [[1.0, 2.0]]
    # 0.3 lies in [0.25, 0.5), where e4m3's step is 0.25 / 8 = 0.03125: 9.6 steps -> 10 -> 0.3125.
    assert q[1, 1].float().item() == 0.3125
    assert q[1, 129].float().item() == 0.3125  # 0.6 / 2 = 0.3, same code, dequantized to 0.625
    deq = dequantize_block(q, scale)
    assert deq[1, 129].item() == 0.625 and deq[0, 128].item() == -896.0 and deq[0, 0].item() == 448.0
    assert deq[0, 1].item() == 0.0  # zeros stay exact


def test_fp8_all_zero_tile_gets_unit_scale_and_stays_zero():
    q, scale = quantize_fp8_block(torch.zeros(3, 5))
    assert scale.tolist() == [[1.0]]
    assert dequantize_block(q, scale).abs().max().item() == 0.0


def test_fp8_scale_grid_is_ceil_of_shape_and_edges_are_partial():
    w = torch.randn(300, 200)
    q, scale = quantize_fp8_block(w)
    assert q.shape == (300, 200) and scale.shape == (math.ceil(300 / 128), math.ceil(200 / 128)) == (3, 2)
    # The bottom-right tile holds rows 256..299 and cols 128..199 only: its scale is their absmax / 448.
    assert scale[2, 1].item() == pytest.approx(w[256:, 128:].abs().max().item() / E4M3_MAX, rel=1e-6)


def test_fp8_error_within_e4m3_bound_in_every_tile():
    """|w - deq| <= max(2^-4 |w|, 2^-10 s) per entry: half a step of e4m3's 3-bit mantissa on normals,
    half the subnormal step 2^-9 (times the tile's scale) below 2^-6. Checked tile by tile, on a
    matrix whose magnitudes span 2^-20..2^8 so both regimes occur, with partial edge tiles."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=gen) * torch.pow(2.0, torch.randint(-20, 8, (300, 260), generator=gen))
    q, scale = quantize_fp8_block(w)
    err = (dequantize_block(q, scale) - w).abs()
    bound = fp8_error_bound(w, scale)
    ratios = [float((e / b).max()) for e, b in zip(_per_tile(err), _per_tile(bound))]
    assert len(ratios) == 3 * 3
    # 1e-6 of slack: float32 rounding of w / s and q * s (2^-24 relative each).
    assert max(ratios) <= 1.0 + 1e-6, f"tile errors exceed the e4m3 bound: {ratios}"
    assert min(ratios) > 0.5, "the bound should be nearly tight (round-to-nearest reaches half a step)"
    scaled = (w / torch.repeat_interleave(torch.repeat_interleave(scale, 128, 0), 128, 1)[:300, :260]).abs()
    assert ((scaled > 0) & (scaled < 2.0**-6)).any() and (scaled >= 2.0**-6).any(), "both regimes exercised"
    # A normal value's relative error alone is <= 2^-4 (the bound's first term).
    normal = scaled >= 2.0**-6
    assert float((err[normal] / w.abs()[normal]).max()) <= 2.0**-4 + 1e-7


def test_an_outlier_changes_only_its_own_tile():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(1))
    q0, s0 = quantize_fp8_block(w)
    w_out = w.clone()
    w_out[130, 5] = 1000.0  # tile (1, 0)
    q1, s1 = quantize_fp8_block(w_out)
    changed = (s0 != s1).nonzero().tolist()
    assert changed == [[1, 0]]
    assert s1[1, 0].item() == pytest.approx(1000.0 / E4M3_MAX)
    d0, d1 = dequantize_block(q0, s0), dequantize_block(q1, s1)
    outside = torch.ones_like(w, dtype=torch.bool)
    outside[128:256, 0:128] = False
    assert torch.equal(d0[outside], d1[outside])  # bit for bit everywhere else
    assert not torch.equal(d0[~outside], d1[~outside])  # its own tile got coarser


def test_int4_hand_computed_values_and_bound():
    w = torch.tensor([[7.0, 3.5, -7.0, 1.4, 0.0]])
    q, scale = quantize_int4_block(w)
    assert scale.tolist() == [[1.0]]  # absmax 7 / 7
    assert q.tolist() == [[7, 4, -7, 1, 0]]  # round half to even: 3.5 -> 4
    w = torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_int4_block(w)
    assert scale.shape == (64, 3) and q.abs().max().item() <= 7
    err = (dequantize_block(q, scale, INT4_BLOCK) - w).abs()
    half_step = torch.repeat_interleave(scale, 128, 1)[:, :300] / 2
    assert (err <= half_step * (1 + 1e-6)).all()


def test_hadamard_matrices():
    assert torch.allclose(hadamard(2), torch.tensor([[1.0, 1.0], [1.0, -1.0]]) / math.sqrt(2))
    h4 = hadamard(4) * 2
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    r = random_hadamard(128, seed=3)
    assert torch.allclose(r @ r.T, torch.eye(128), atol=1e-5)
    assert not torch.equal(r, hadamard(128))  # the signs are random
    assert rotation_size(512) == 128 and rotation_size(96) == 32 and rotation_size(51) == 1
    with pytest.raises(AssertionError, match="power of two"):
        hadamard(12)


def test_rotation_is_undone_exactly_without_quantization():
    w = torch.randn(8, 256)
    r = random_hadamard(128)
    assert torch.allclose(rotate(rotate(w, r), r.T), w, atol=1e-5)
    # An outlier channel is spread over the 128 channels of its rotation block.
    spike = torch.zeros(1, 128)
    spike[0, 7] = 1.0
    assert torch.allclose(rotate(spike, r).abs(), torch.full((1, 128), 1 / math.sqrt(128)))


def _planted_outliers(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w[:, torch.randperm(cols, generator=gen)[:4]] *= 20  # a few outlier input channels (QuaRot's motivation)
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_reduces_int4_error_with_planted_outliers(seed):
    w = _planted_outliers(256, 512, seed)
    rel = lambda x: float((x - w).norm() / w.norm())  # noqa: E731
    plain, rotated = rel(fake_quantize(w, "int4_block")), rel(fake_quantize(w, "int4_block", rotation=True))
    assert rotated < 0.5 * plain, f"INT4 relative error {plain:.3f} -> {rotated:.3f} with rotation"


def test_fake_quantize_rejects_unknown_format():
    with pytest.raises(ValueError, match="'int3'"):
        fake_quantize(torch.ones(2, 2), "int3")


def test_state_dict_round_trip(small_model):
    names = linear_weight_names(small_model)
    assert names and all(n.endswith("proj.weight") for n in names)  # q/k/v/o and MLP projections, no head
    sd = small_model.state_dict()
    packed = quantize_state_dict(sd, names)
    for n in names:
        assert packed[n].dtype == torch.float8_e4m3fn
        scale = packed[n.removesuffix("weight") + "weight_scale"]
        assert scale.shape == tuple(math.ceil(d / 128) for d in sd[n].shape)
    assert torch.equal(packed["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    back = dequantize_state_dict(packed)
    assert back.keys() == sd.keys()
    for n in names:
        _, scale = quantize_fp8_block(sd[n])
        assert ((back[n] - sd[n]).abs() <= fp8_error_bound(sd[n], scale) * (1 + 1e-6)).all()
    nbytes = lambda d: sum(t.numel() * t.element_size() for t in d.values())  # noqa: E731
    linear_fp32 = sum(sd[n].numel() * 4 for n in names)
    assert nbytes(sd) - nbytes(packed) >= 0.7 * linear_fp32  # 4 bytes -> 1 byte (+ a few scales)
    assert dequantize_state_dict(sd) == dict(sd)  # nothing to dequantize: unchanged


def test_dequantize_accepts_the_deepseek_scale_name():
    q, s = quantize_fp8_block(torch.randn(4, 4))
    out = dequantize_state_dict({"l.weight": q, "l.weight_scale_inv": s})
    assert set(out) == {"l.weight"} and torch.equal(out["l.weight"], dequantize_block(q, s))
