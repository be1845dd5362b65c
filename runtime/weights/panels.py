"""The kernels' panel layout, shared by every packed format: output rows in panels of 16.

Rows are padded with zeros to P = ceil(N/16) panels. Per format (runtime/_native/qlinear/layout.h describes them):
  "qweight" codes, panel-major: int4 uint8 [P, K/8, 64], int5 uint8 [P, K/8, 80], int6 uint8 [P, K/8, 96],
            int8 int8 [P, K/4, 64], fp8 uint8 [P, K, 16], bf16 [P, K, 16]. int4, int5 and int6 share the
            nibble layout (nibble_codes): per k-block of 8, 64 bytes of low nibbles, then int5's 16 bytes
            of bit 4 (byte r: row r's 8 codes, bit j for k step j) or int6's 32 bytes of bits 4-5 (row r's
            little-endian uint16, bits 2j, 2j+1 for k step j);
  "scales"  [P, K/G, 16] f32, or f16 when that is lossless (G = 1 group per channel: [P, 1, 16]);
  int4: "zeros" [P, K/G, 16] f32, or "mins" f16 (m = zero - 8 * scale) when f16 (scale, m) is lossless;
  int5: "mins" [P, K/G, 16] (m, the value of code 0) in the scales' dtype.
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


def nibble_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q uint8 [N, K] (K a multiple of 8) of `bits` 4, 5 or 6 -> uint8 [P, K/8, 8 * 2 * bits], layout.h's order."""
    k = q.shape[1]
    cells = pad_rows(q & 15).reshape(-1, PANEL, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [P, K/8, 16, 4, lo|hi]
    low = (cells[..., 0] | (cells[..., 1] << 4)).reshape(-1, k // 8, 64)
    if bits == 4:
        return low.contiguous()
    width = bits - 4  # high bits a code: 1 (int5) or 2 (int6)
    high = pad_rows(q >> 4).reshape(-1, PANEL, k // 8, 8).permute(0, 2, 1, 3).to(torch.int32)  # [P, K/8, 16, 8]
    word = (high << (width * torch.arange(8, dtype=torch.int32))).sum(-1)  # [P, K/8, 16]: 8 or 16 bits a row
    word_bytes = torch.stack([word & 255, word >> 8], -1) if width == 2 else word[..., None]  # little-endian
    return torch.cat([low, word_bytes.reshape(low.shape[0], k // 8, -1).to(torch.uint8)], -1).contiguous()


def nibble_values(codes: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """The q uint8 [N, K] that nibble_codes packed into `codes`."""
    c = codes.reshape(-1, k // 8, codes.shape[-1])
    low = c[..., :64].reshape(-1, k // 8, PANEL, 4)
    q = torch.stack([low & 15, low >> 4], dim=3).reshape(-1, k // 8, PANEL, 8)  # [P, K/8, 16, 8]
    if bits > 4:
        width = bits - 4
        word = c[..., 64:].reshape(-1, k // 8, PANEL, width).to(torch.int32)
        word = word[..., 0] | (word[..., 1] << 8) if width == 2 else word[..., 0]  # [P, K/8, 16]
        high = (word[..., None] >> (width * torch.arange(8, dtype=torch.int32))) & ((1 << width) - 1)
        q = q | (high.to(torch.uint8) << 4)
    return q.permute(0, 2, 1, 3).reshape(-1, k)[:n].contiguous()


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


def check_codes(fn: str, q, group_size: int, levels: int, per_group: dict, allowed=GROUP_SIZES) -> tuple[int, int]:
    """The checks of a pack over unsigned codes q uint8 [N, K] in 0..levels and float32 [N, K/G] tensors
    (scales, zeros, mins) by name; (N, K)."""
    n, k = check_matrix(fn, q)
    check_group(fn, k, group_size, allowed)
    expect_shape(fn, "q", q, torch.uint8, (n, k))
    for name, t in per_group.items():
        expect_shape(fn, name, t, torch.float32, (n, k // group_size))
    if q.numel() and int(q.max()) > levels:
        fail(fn, f"q values must lie in 0..{levels}, found {int(q.max())}")
    return n, k


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
