"""BF16: w as stored, rounded to bfloat16, packed in the kernels' panel layout (bf16 [P, K, 16]); no logical form."""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape, fail
from runtime.weights import panels
from runtime.weights.format import WeightFormat

LAYOUT = "bf16.p16k1"


def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] (rounded to bf16 if wider) -> {"qweight": bf16 [P, K, 16]}."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        fail("pack_bf16", "w must be a 2-D floating torch.Tensor [N, K]")
    n, k = w.shape
    panels.check_step("pack_bf16", k)
    return {"qweight": panels.pad_rows(w.to(torch.bfloat16)).reshape(-1, panels.PANEL, k).transpose(1, 2).contiguous()}


def dequantize_packed(packed: dict, out_features: int, in_features: int, group_size: None = None) -> torch.Tensor:
    codes = check_packed("dequantize_bf16", packed, out_features, in_features)[0]
    return codes.transpose(1, 2).reshape(-1, in_features)[:out_features].float()


def check_packed(fn: str, packed: dict, n: int, k: int, group_size: None = None):
    """(codes, None, None, False) as the kernel takes them."""
    panels.check_step(fn, k)
    codes = panels.packed_part(fn, packed, "qweight")
    expect_shape(fn, "qweight", codes, torch.bfloat16, (panels.panels(n), k, panels.PANEL))
    return codes, None, None, False


FORMAT = WeightFormat("bf16", LAYOUT, _C.FMT_BF16, (), integer_activations=False,
                      pack=lambda logical, group_size: pack(*logical), check=check_packed,
                      dequantize_packed=dequantize_packed)
