"""INT6: w[n,k] = (q[n,k] - 32) * scale[n, k//G], q in 0..63, G in {16, 32, 64, 128}.

GGUF's Q6_K blocks (16-weight sub-blocks) are this format with G = 16, exactly (builder/sources/gguf_blocks.py).
The math, the packing into the kernels' panel layout (codes uint8 [P, K/8, 96]: int4's 64 bytes of low
nibbles, then 32 bytes of bits 4-5) and the packed checks the kernel binds. Only f32 activations
compute with it.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape
from runtime.weights import panels
from runtime.weights.format import WeightFormat, expand_scales

LAYOUT = "q6g.p16k8"
LEVELS = 63
BITS = 6
GROUP_SIZES = (16,) + panels.GROUP_SIZES


# ------------------------------------------------------------------------------------------ math

def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w f32 [N, K] = (q - 32) * scale: exact in float64 (6 x 24 bits), so rounded once, as the kernels' f32 product."""
    return ((q.double() - 32) * expand_scales(scales, q.shape[1])).float()


# ------------------------------------------------------------------------------------------ packing

def pack(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in 0..63, scales f32 [N, K/G] -> {"qweight", "scales"} (f16 when lossless)."""
    panels.check_codes("pack_int6", q, group_size, LEVELS, {"scales": scales}, GROUP_SIZES)
    return {"qweight": panels.nibble_codes(q, BITS), "scales": panels.panel_scales(panels.f16_if_exact(scales))}


def unpack(packed: dict, out_features: int, in_features: int, group_size: int):
    """The exact (q uint8 [N, K], scales f32 [N, K/G]) that pack took."""
    codes, scales, _, _ = check_packed("unpack_int6", packed, out_features, in_features, group_size)
    q = panels.nibble_values(codes, out_features, in_features, BITS)
    return q, panels.row_scales(scales, out_features).float().contiguous()


def dequantize_packed(packed: dict, out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    return dequantize(*unpack(packed, out_features, in_features, group_size))


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: int):
    """(codes, scales, None, scales are f16) as the kernel takes them."""
    panels.check_group(fn, k, group_size, GROUP_SIZES)
    p = panels.panels(n)
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.uint8, (p, k // 8, 16 * BITS))
    scales = panels.packed_scales(fn, packed, "scales", (p, k // group_size, panels.PANEL))
    return codes, scales, None, scales.dtype == torch.float16


FORMAT = WeightFormat("int6", LAYOUT, _C.FMT_Q6, ("qweight", "scales"), integer_activations=False,
                      pack=lambda logical, group_size: pack(*logical, group_size), check=check_packed,
                      dequantize_packed=dequantize_packed)
