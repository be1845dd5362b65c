"""The kernels' panel layout, shared by every packed format: output rows in panels of 16.

Rows are padded with zeros to P = ceil(N/16) panels. Per format (runtime/_native/qlinear/layout.h describes them):
  "qweight" codes, panel-major: int4 uint8 [P, K/8, 64], int8 int8 [P, K/4, 64], fp8 uint8 [P, K, 16],
            bf16 [P, K, 16] (the byte order inside a panel is each format module's pack);
  "scales"  [P, K/G, 16] f32, or f16 when that is lossless (G = 1 group per channel: [P, 1, 16]);
  int4: "zeros" [P, K/G, 16] f32, or "mins" f16 (m = zero - 8 * scale) when f16 (scale, m) is lossless.
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.ops.checks import expect_shape, fail

PANEL = _C.PANEL
GROUP_SIZES = (32, 64, 128)


def panels(n: int) -> int:
    return (n + PANEL - 1) // PANEL


def pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [P*16, ...] with zero rows appended."""
    pad = panels(t.shape[0]) * PANEL - t.shape[0]
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))]) if pad else t


def panel_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, groups] -> [P, groups, 16]."""
    s = pad_rows(s)
    return s.reshape(-1, PANEL, s.shape[1]).transpose(1, 2).contiguous()


def row_scales(s: torch.Tensor, n: int) -> torch.Tensor:
    """[P, groups, 16] -> [N, groups]."""
    return s.transpose(1, 2).reshape(-1, s.shape[1])[:n]


def f16_if_exact(s: torch.Tensor) -> torch.Tensor:
    half = s.half()
    return half if torch.equal(half.float(), s) else s


def check_matrix(fn: str, q) -> tuple[int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        fail(fn, "q must be a 2-D torch.Tensor [N, K]")
    return q.shape


def check_group(fn: str, k: int, group_size: int | None, allowed=GROUP_SIZES) -> None:
    if group_size not in allowed:
        fail(fn, f"group_size must be one of {allowed}, got {group_size}")
    if group_size is not None and k % group_size:
        fail(fn, f"in_features {k} is not divisible by group_size {group_size}")


def check_step(fn: str, k: int) -> None:
    """The int8, fp8 and bf16 kernels read K in steps of 8."""
    if k % 8:
        fail(fn, f"in_features {k} must be a multiple of 8")


def packed_part(fn: str, packed: dict, key: str) -> torch.Tensor:
    if not isinstance(packed, dict) or key not in packed:
        fail(fn, f"packed weights lack {key!r} (have {sorted(packed) if isinstance(packed, dict) else packed!r})")
    t = packed[key]
    if isinstance(t, torch.Tensor) and not t.is_contiguous():
        fail(fn, f"packed {key!r} must be contiguous")
    return t


def packed_scales(fn: str, packed: dict, key: str, shape: tuple) -> torch.Tensor:
    """packed[key], f16 or f32 of `shape`."""
    s = packed_part(fn, packed, key)
    dtype = s.dtype if isinstance(s, torch.Tensor) and s.dtype in (torch.float16, torch.float32) else torch.float32
    expect_shape(fn, key, s, dtype, shape)
    return s
