"""INT5 with mins: w[n,k] = fma(q[n,k], scale[n, k//G], min[n, k//G]), q in 0..31, G in {32, 64, 128}.

The min is the value of code 0, and each weight is rounded once (an f32 fma), which is how GGUF's
Q5_0, Q5_1 and Q5_K blocks dequantize: builder/sources/gguf_blocks.py maps them here exactly. The math, the
packing into the kernels' panel layout (codes uint8 [P, K/8, 80]: int4's 64 bytes of low nibbles, then
16 bytes of bit 4) and the packed checks the kernel binds. Only f32 activations compute with it.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape, fail
from runtime.weights import panels
from runtime.weights.format import WeightFormat, expand_scales

LAYOUT = "q5g.p16k8"
LEVELS = 31
BITS = 5


# ------------------------------------------------------------------------------------------ math

def dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """w f32 [N, K] = fma(q, scale, min), rounded once as the kernels' fmaf rounds it."""
    k = q.shape[1]
    return fma_f32(q.double(), expand_scales(scales, k), expand_scales(mins, k))


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32(a * b + c) rounded once, for float64 a, b, c whose product a * b is exact in float64.

    The float64 sum is rounded to odd (an inexact sum whose last bit is 0 moves one ulp towards the
    exact value): with 53 >= 24 + 2 bits, rounding that to float32 is the single rounding of the
    exact sum (Boldo and Melquiond, "When double rounding is odd"), so even a sum in a float32 tie
    rounds as fmaf does.
    """
    p = a * b
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)  # the exact sum is s + err (TwoSum)
    bits = s.view(torch.int64)
    away = (err != 0) & ((bits & 1) == 0)
    toward_err = torch.where((err > 0) == (s > 0), 1, -1)  # +1 ulp moves |s| up
    return torch.where(away, bits + toward_err, bits).view(torch.float64).float()


# ------------------------------------------------------------------------------------------ packing

def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in 0..31, scales/mins f32 [N, K/G] -> {"qweight", "scales", "mins"} (f16 when lossless)."""
    panels.check_codes("pack_int5", q, group_size, LEVELS, {"scales": scales, "mins": mins})
    s, m = scales.half(), mins.half()
    if not (torch.equal(s.float(), scales) and torch.equal(m.float(), mins)):  # f16 only when both are lossless
        s, m = scales, mins
    return {"qweight": panels.nibble_codes(q, BITS), "scales": panels.panel_scales(s),
            "mins": panels.panel_scales(m)}


def unpack(packed: dict, out_features: int, in_features: int, group_size: int):
    """The exact (q uint8 [N, K], scales f32 [N, K/G], mins f32 [N, K/G]) that pack took."""
    codes, scales, mins, _ = check_packed("unpack_int5", packed, out_features, in_features, group_size)
    n = out_features
    q = panels.nibble_values(codes, n, in_features, BITS)
    return q, panels.row_scales(scales, n).float().contiguous(), panels.row_scales(mins, n).float().contiguous()


def dequantize_packed(packed: dict, out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    return dequantize(*unpack(packed, out_features, in_features, group_size))


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: int):
    """(codes, scales, mins, scales are f16) as the kernel takes them."""
    panels.check_group(fn, k, group_size)
    p, ng = panels.panels(n), k // group_size
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.uint8, (p, k // 8, 16 * BITS))
    scales = panels.packed_scales(fn, packed, "scales", (p, ng, panels.PANEL))
    mins = panels.packed_scales(fn, packed, "mins", (p, ng, panels.PANEL))
    if mins.dtype != scales.dtype:
        fail(fn, f"int5 packs scales and mins in one dtype, got {scales.dtype} and {mins.dtype}")
    return codes, scales, mins, scales.dtype == torch.float16


FORMAT = WeightFormat("int5", LAYOUT, _C.FMT_Q5, ("qweight", "scales", "mins"), integer_activations=False,
                      pack=lambda logical, group_size: pack(*logical, group_size), check=check_packed,
                      dequantize_packed=dequantize_packed)
