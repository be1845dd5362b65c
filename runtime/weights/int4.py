"""INT4 with zero points: w[n,k] = (q[n,k] - 8) * scale[n, k//G] + zero[n, k//G], q in 0..15, G in {32, 64, 128}.

The math (quantize, dequantize, the fast fake quantization AWQ searches with), the packing into the
kernels' panel layout (codes uint8 [P, K/8, 64]: two codes a byte) and the packed checks the kernel binds.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape, fail
from runtime.weights import panels
from runtime.weights.format import (NOT_MEASURED, Quantized, WeightFormat, expand_scales, group_blocks, nonzero_scales,
                                    relative_error)

LAYOUT = "q4g.p16k8"
LEVELS = 15


# ------------------------------------------------------------------------------------------ math

def quantize(w: torch.Tensor, group_size: int, measure: bool = True) -> Quantized:
    """Group-wise asymmetric INT4 (round to nearest): each group's [min, max] spread over 16 levels."""
    blocks = group_blocks(w, group_size)
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K/G]
    scales = (hi - lo) / LEVELS
    q = torch.round((blocks - lo[..., None]) / nonzero_scales(scales)[..., None]).clamp(0, LEVELS)
    q = q.to(torch.uint8).reshape(w.shape)
    zeros = lo + 8 * scales  # w = q * scale + lo = (q - 8) * scale + zero
    return Quantized(q, scales, zeros, relative_error(w, dequantize(q, scales, zeros)) if measure else NOT_MEASURED)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, K even -> uint8 [N, K/2]: byte j holds code 2j in its low nibble, 2j+1 in its high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the codes uint8 [N, K] that pack_nibbles took."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    return ((q.double() - 8) * expand_scales(scales, k) + expand_scales(zeros, k)).float()


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """quantize then dequantize in float32: equal to dequantize(*quantize(w)[:3]) up to float32 rounding,
    and a few times faster (the weights AWQ's searches compare)."""
    return fake_quantize_rows(group_blocks(w, group_size)).reshape(w.shape)


def fake_quantize_rows(w: torch.Tensor) -> torch.Tensor:
    """fake_quantize with one group per row of the last dimension."""
    lo = w.amin(-1, keepdim=True)
    scales = (w.amax(-1, keepdim=True) - lo) / LEVELS
    return (w - lo).div_(nonzero_scales(scales)).round_().clamp_(0, LEVELS).mul_(scales).add_(lo)


# ------------------------------------------------------------------------------------------ packing

def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in 0..15, scales/zeros f32 [N, K/G] -> {"qweight", "scales", "zeros" | "mins"}."""
    panels.check_codes("pack_int4", q, group_size, LEVELS, {"scales": scales, "zeros": zeros})
    packed = {"qweight": panels.nibble_codes(q, 4)}
    d = scales.half()
    m = (zeros.double() - 8 * scales.double()).half()
    if torch.equal(d.float(), scales) and torch.equal((m.double() + 8 * d.double()).float(), zeros):
        packed.update(scales=panels.panel_scales(d), mins=panels.panel_scales(m))  # lossless: 2 + 2 bytes per group
    else:
        packed.update(scales=panels.panel_scales(scales), zeros=panels.panel_scales(zeros))
    return packed


def unpack(packed: dict, out_features: int, in_features: int, group_size: int):
    """The exact (q uint8 [N, K], scales f32 [N, K/G], zeros f32 [N, K/G]) that pack took."""
    codes, scales, zeros, _ = check_packed("unpack_int4", packed, out_features, in_features, group_size)
    n, k = out_features, in_features
    q = panels.nibble_values(codes, n, k, 4)
    s = panels.row_scales(scales, n).float()
    if "mins" in packed:
        z = (panels.row_scales(zeros, n).double() + 8 * s.double()).float()
    else:
        z = panels.row_scales(zeros, n)
    return q, s.contiguous(), z.contiguous()


def dequantize_packed(packed: dict, out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    """w f32 [N, K] = (q - 8) * scale + zero, rounded once from float64 (what the kernel computes)."""
    q, s, z = unpack(packed, out_features, in_features, group_size)
    expand = lambda t: t.double().repeat_interleave(group_size, dim=1)  # noqa: E731
    return ((q.double() - 8) * expand(s) + expand(z)).float()


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: int):
    """(codes, scales, zeros or mins, scales are f16) as the kernel takes them."""
    panels.check_group(fn, k, group_size)
    p, ng = panels.panels(n), k // group_size
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.uint8, (p, k // 8, 64))
    scales = panels.packed_scales(fn, packed, "scales", (p, ng, panels.PANEL))
    zero_key = "mins" if "mins" in packed else "zeros"
    zeros = panels.packed_scales(fn, packed, zero_key, (p, ng, panels.PANEL))
    if (zero_key == "mins") != (scales.dtype == torch.float16) or zeros.dtype != scales.dtype:
        fail(fn, "int4 packs f16 scales with f16 'mins', or f32 scales with f32 'zeros'")
    return codes, scales, zeros, scales.dtype == torch.float16


FORMAT = WeightFormat("int4", LAYOUT, _C.FMT_Q4, ("qweight", "scales", "zeros"), integer_activations=True,
                      pack=lambda logical, group_size: pack(*logical, group_size), check=check_packed,
                      dequantize_packed=dequantize_packed)
