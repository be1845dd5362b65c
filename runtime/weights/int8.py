"""Symmetric INT8: w[n,k] = q[n,k] * scale[n] (per channel) or q[n,k] * scale[n, k//G] (groups, e.g. GGUF Q8_0).

The math, the packing into the kernels' panel layout (codes int8 [P, K/4, 64]: four codes of one row
side by side) and the packed checks the kernel binds.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape
from runtime.weights import panels
from runtime.weights.format import (NOT_MEASURED, Quantized, WeightFormat, expand_scales, group_blocks, nonzero_scales,
                                    relative_error)

LAYOUT = "q8.p16k4"
MAX = 127
GROUP_SIZES = panels.GROUP_SIZES + (None,)  # None: one scale per output channel


# ------------------------------------------------------------------------------------------ math

def quantize(w: torch.Tensor, group_size: int | None = None, measure: bool = True) -> Quantized:
    """Symmetric INT8: scale = max|w| / 127 per output channel (or per group of `group_size` inputs)."""
    blocks = group_blocks(w, group_size or w.shape[1])
    scales = blocks.abs().amax(-1) / MAX  # [N, K/G]
    q = torch.round(blocks / nonzero_scales(scales)[..., None]).clamp(-MAX, MAX).to(torch.int8)
    q = q.reshape(w.shape)
    scales = scales if group_size else scales[:, 0]
    return Quantized(q, scales, None, relative_error(w, dequantize(q, scales)) if measure else NOT_MEASURED)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.double() * expand_scales(scales, q.shape[1])).float()


# ------------------------------------------------------------------------------------------ packing

def pack(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """q int8 [N, K], scales f32 [N] (per channel, group_size None) or [N, K/G] -> {"qweight", "scales"}."""
    fn = "pack_int8"
    n, k = panels.check_matrix(fn, q)
    panels.check_group(fn, k, group_size, GROUP_SIZES)
    panels.check_step(fn, k)
    expect_shape(fn, "q", q, torch.int8, (n, k))
    expect_shape(fn, "scales", scales, torch.float32, (n,) if group_size is None else (n, k // group_size))
    qweight = panels.pad_rows(q).reshape(-1, panels.PANEL, k // 4, 4).transpose(1, 2).reshape(-1, k // 4, 64)
    scales = scales.reshape(n, -1)
    return {"qweight": qweight.contiguous(), "scales": panels.panel_scales(panels.f16_if_exact(scales))}


def unpack(packed: dict, out_features: int, in_features: int, group_size: int | None = None):
    """The exact (q int8 [N, K], scales f32 [N] or [N, K/G]) that pack took."""
    codes, scales, _, _ = check_packed("unpack_int8", packed, out_features, in_features, group_size)
    n, k = out_features, in_features
    q = codes.reshape(-1, k // 4, panels.PANEL, 4).transpose(1, 2).reshape(-1, k)[:n]
    s = panels.row_scales(scales, n).float()
    return q.contiguous(), (s[:, 0] if group_size is None else s).contiguous()


def dequantize_packed(packed: dict, out_features: int, in_features: int,
                      group_size: int | None = None) -> torch.Tensor:
    q, s = unpack(packed, out_features, in_features, group_size)
    s = s[:, None] if group_size is None else s.repeat_interleave(group_size, dim=1)
    return (q.double() * s.double()).float()


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: int | None):
    """(codes, scales, None, scales are f16) as the kernel takes them."""
    panels.check_group(fn, k, group_size, GROUP_SIZES)
    panels.check_step(fn, k)
    p = panels.panels(n)
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.int8, (p, k // 4, 64))
    scales = panels.packed_scales(fn, packed, "scales", (p, 1 if group_size is None else k // group_size, panels.PANEL))
    return codes, scales, None, scales.dtype == torch.float16


FORMAT = WeightFormat("int8", LAYOUT, _C.FMT_Q8, ("qweight", "scales"), integer_activations=True,
                      pack=lambda logical, group_size: pack(*logical, group_size), check=check_packed,
                      dequantize_packed=dequantize_packed)
