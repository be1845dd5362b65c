"""FP8 e4m3: w[n,k] = e4m3(q[n,k]) * scale[n] (per channel, or one scale per tensor); the cpu kernel computes in f32.

The math, the packing into the kernels' panel layout (codes uint8 [P, K, 16]: one byte a code, 16
rows side by side) and the packed checks the kernel binds.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape, fail
from runtime.weights import panels
from runtime.weights.format import NOT_MEASURED, Quantized, WeightFormat, nonzero_scales, relative_error

LAYOUT = "f8e4m3.p16k1"
MAX = 448.0  # largest finite float8_e4m3fn


# ------------------------------------------------------------------------------------------ math

def quantize(w: torch.Tensor, per_channel: bool = True, measure: bool = True) -> Quantized:
    """FP8 e4m3 with scale = max|w| / 448 per output channel, or one scale for the whole tensor."""
    w = w.float()
    amax = w.abs().amax(1) if per_channel else w.abs().amax().reshape(1)
    scales = amax / MAX  # [N] or [1]
    scaled = w / nonzero_scales(scales)[:, None] if per_channel else w / nonzero_scales(scales)
    q = scaled.clamp(-MAX, MAX).to(torch.float8_e4m3fn)
    return Quantized(q, scales, None, relative_error(w, dequantize(q, scales)) if measure else NOT_MEASURED)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.double() * scales.double().reshape(-1, 1)).float()


def fake_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 e4m3 activation with one static scale reads it: e4m3(x / scale) * scale, saturated at +-448
    (ONNX QuantizeLinear then DequantizeLinear, which TensorRT folds into an FP8 GEMM), in x's dtype."""
    q = (x.float() / scale).clamp(-MAX, MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


# ------------------------------------------------------------------------------------------ packing

def pack(q: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q float8_e4m3fn (or its uint8 codes) [N, K], scales f32 [N] or a scalar -> {"qweight", "scales"}."""
    fn = "pack_fp8"
    panels.check_matrix(fn, q)
    if q.dtype == torch.float8_e4m3fn:
        q = q.view(torch.uint8)
    n, k = q.shape
    expect_shape(fn, "q", q, torch.uint8, (n, k))
    panels.check_step(fn, k)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.numel() not in (1, n):
        fail(fn, f"scales must be f32 [N={n}] or a single value")
    if bool(((q & 0x7F) == 0x7F).any()):
        fail(fn, "q holds e4m3 NaN codes")
    qweight = panels.pad_rows(q).reshape(-1, panels.PANEL, k).transpose(1, 2).contiguous()
    return {"qweight": qweight,
            "scales": panels.panel_scales(scales.reshape(-1).expand(n).reshape(n, 1).contiguous())}


def dequantize_packed(packed: dict, out_features: int, in_features: int, group_size: None = None) -> torch.Tensor:
    codes, scales, _, _ = check_packed("dequantize_fp8", packed, out_features, in_features)
    q = codes.transpose(1, 2).reshape(-1, in_features)[:out_features].contiguous()
    values = q.view(torch.float8_e4m3fn).double()
    return (values * panels.row_scales(scales, out_features).double()).float()


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: None = None):
    """(codes, scales, None, False) as the kernel takes them (one f32 scale per channel, no groups)."""
    panels.check_step(fn, k)
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.uint8, (panels.panels(n), k, panels.PANEL))
    scales = panels.packed_part(fn, packed, "scales")
    expect_shape(fn, "scales", scales, torch.float32, (panels.panels(n), 1, panels.PANEL))
    return codes, scales, None, False


FORMAT = WeightFormat("fp8", LAYOUT, _C.FMT_F8, ("qweight", "scales"), integer_activations=False,
                      pack=lambda logical, group_size: pack(*logical), check=check_packed,
                      dequantize_packed=dequantize_packed)
