"""GGUF quantized blocks as Kiln weight formats: BLOCK_FORMATS maps a block type to the format, group
size and conversion that keep its weights exactly, each dequantized weight gguf-py's float32 value.

  Q4_0, Q4_1, Q4_K   int4, group 32   (q - 8) * s + z
  Q5_0, Q5_1, Q5_K   int5, group 32   fma(q, s, m)
  Q6_K               int6, group 16   (q - 32) * s
  Q8_0               int8, group 32   q * s

Why int5 and int6 give gguf-py's floats bit for bit (gguf.quants dequantizes in float32, d and dmin
f16, the sub-block scales integers): a product of an f16 value (11 significant bits) by a small
integer is exact in float32, so
  Q5_0  gguf-py d * (q - 16) is exact; fma(q, d, -16d) adds two exact terms, q d and -16d, whose sum
        d (q - 16) is the same exact value;
  Q5_1  gguf-py rounds d q + m once (d q exact); fma(q, d, m) rounds the same exact sum once;
  Q5_K  s = d sc[j] (11 + 6 bits) and dmin mn[j] are exact, so are s q (17 + 5 bits); gguf-py rounds
        s q - dmin mn[j] once, as fma(q, s, -dmin mn[j]) does;
  Q6_K  s = d sc[j] (11 + 7 bits, sc int8) and s (q - 32) (18 + 5 bits) are exact both ways.
Other quantized types (Q2_K, Q3_K, the IQ and TQ types) have no exact Kiln format: under method
"source" they are requantized to REQUANT_SOURCE_FORMAT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from builder.sources.model import RawBlocks
from runtime.weights import FORMATS

BLOCK = 32  # elements per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block, and per Q4_K / Q5_K sub-block
SUPER_BLOCK = 256  # elements per K-quant block


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 at byte `offset` of every block, as float32 [..., blocks]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibble_codes(nibbles: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)


def _k_nibbles(nibbles: np.ndarray, rows: int) -> np.ndarray:
    """A Q4_K / Q5_K block's 128 bytes of nibbles [N, blocks, 128] -> codes [N, blocks, 8 sub-blocks, 32]: they come
    in 64-weight runs of 32 bytes, low nibbles the run's first 32 weights, high nibbles its last 32."""
    runs = nibbles.reshape(rows, -1, 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-2).reshape(rows, -1, 8, 32)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """d, dmin [N, blocks, 1] and the eight 6-bit sub-block scales sc and mins m [N, blocks, 8] (float32) of the
    Q4_K / Q5_K header: d, dmin (f16), then 12 bytes: 0-3 scale low bits, 4-7 min low bits, 8-11 high bits."""
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    packed = blocks[..., 4:16].reshape(*blocks.shape[:2], 3, 4)
    lo_sc, lo_m, hi = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], axis=-1).astype(np.float32)
    return d, dmin, sc, m


def _as_torch(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)


# ------------------------------------------------------------------------------------------ int4

def gguf_blocks_to_int4(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks as Kiln's int4 group-32 layout: w = (q - 8) * scale + zero.

    A Q4_1 block is (d f16, m f16, 16 bytes of nibbles) with w = q * d + m, so scale = d and
    zero = m + 8d. Returns q uint8 [N, K] in 0..15, scale f32 [N, K/32], zero f32 [N, K/32].
    """
    if raw.ggml_type != "Q4_1":
        raise ValueError(f"gguf_blocks_to_int4: expected Q4_1 blocks, got {raw.ggml_type}")
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // BLOCK, 20)  # [N, K/32, 2 + 2 + 16 bytes]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _as_torch(_nibble_codes(blocks[..., 4:]).reshape(rows, cols), d, m + 8 * d)


def gguf_q4_0_to_int4(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 blocks (d f16, 16 bytes of nibbles; w = (q - 8) * d) as Kiln's int4: scale = d, zero = 0."""
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // BLOCK, 18)
    d = _f16(blocks, 0)
    return _as_torch(_nibble_codes(blocks[..., 2:]).reshape(rows, cols), d, np.zeros_like(d))


def gguf_q4_k_to_int4(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks as Kiln's int4 group-32 layout, exactly.

    A Q4_K block covers 256 weights (144 bytes): d and dmin (f16), 12 bytes packing eight 6-bit sub-block
    scales sc and mins m, and 128 bytes of nibbles; sub-block j (32 weights) is w = d * sc[j] * q - dmin * m[j].
    So scale = d * sc[j] and zero = 8 * scale - dmin * m[j].
    """
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // SUPER_BLOCK, 144)
    d, dmin, sc, m = _k_scales(blocks)
    scale = (d * sc).reshape(rows, -1)
    zero = 8 * scale - (dmin * m).reshape(rows, -1)
    return _as_torch(_k_nibbles(blocks[..., 16:], rows).reshape(rows, cols), scale, zero)


# ------------------------------------------------------------------------------------------ int5

def _q5_codes(high: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes [..., 32] in 0..31: element i's bit 4 is bit i of the 4 bytes `high` (a little-endian
    uint32), its low bits the nibbles as Q4_0's."""
    return _nibble_codes(nibbles) | (np.unpackbits(high, axis=-1, bitorder="little") << 4)


def gguf_q5_0_to_int5(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 blocks (22 bytes: d f16, 4 bytes of bit 4, 16 bytes of nibbles; w = d * (q - 16)) as Kiln's
    int5 group 32: scale = d, min = -16d. Returns q uint8 [N, K] in 0..31, scale and min f32 [N, K/32]."""
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // BLOCK, 22)
    d = _f16(blocks, 0)
    return _as_torch(_q5_codes(blocks[..., 2:6], blocks[..., 6:]).reshape(rows, cols), d, -16 * d)


def gguf_q5_1_to_int5(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 blocks (24 bytes: d f16, m f16, 4 bytes of bit 4, 16 bytes of nibbles; w = d * q + m) as Kiln's
    int5 group 32: scale = d, min = m."""
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // BLOCK, 24)
    codes = _q5_codes(blocks[..., 4:8], blocks[..., 8:]).reshape(rows, cols)
    return _as_torch(codes, _f16(blocks, 0), _f16(blocks, 2))


def gguf_q5_k_to_int5(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K blocks as Kiln's int5 group-32 layout, exactly.

    A Q5_K block covers 256 weights (176 bytes): Q4_K's d, dmin and 12 bytes of sub-block scales sc and
    mins m, 32 bytes of bit 4 (weight i of sub-block j: bit j of byte i), then Q4_K's 128 bytes of nibbles;
    sub-block j is w = d * sc[j] * q - dmin * m[j]. So scale = d * sc[j] and min = -(dmin * m[j]).
    """
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // SUPER_BLOCK, 176)
    d, dmin, sc, m = _k_scales(blocks)
    high = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [N, blocks, 32 weights, 8 sub-blocks]
    codes = _k_nibbles(blocks[..., 48:], rows) | (high.swapaxes(-1, -2) << 4)
    return _as_torch(codes.reshape(rows, cols), (d * sc).reshape(rows, -1), -(dmin * m).reshape(rows, -1))


# ------------------------------------------------------------------------------------------ int6

def gguf_q6_k_to_int6(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks as Kiln's int6 group-16 layout, exactly.

    A Q6_K block covers 256 weights (210 bytes): 128 bytes of low nibbles, 64 bytes of bits 4-5, sixteen
    int8 sub-block scales sc and d (f16); sub-block j (16 weights) is w = d * sc[j] * (q - 32). Each
    128-weight half takes 64 nibble bytes (weight 64s + i: byte i's low nibble for s = 0, high for s = 1)
    and 32 high bytes (weight 32t + i: bits 2t, 2t+1 of byte i). So scale = d * sc[j]. Returns q uint8
    [N, K] in 0..63 and scale f32 [N, K/16].
    """
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // SUPER_BLOCK, 210)
    nibbles = blocks[..., :128].reshape(rows, -1, 2, 1, 64)
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-2)  # [N, blocks, 2 halves, s, 64]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> shifts) & 3  # [N, blocks, 2 halves, t, 32]
    codes = low.reshape(rows, cols) | (high.reshape(rows, cols) << 4)
    scale = _f16(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
    return _as_torch(codes, scale.reshape(rows, -1))


# ------------------------------------------------------------------------------------------ int8

def gguf_blocks_to_int8(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (d f16, 32 x int8) as q int8 [N, K] and scale f32 [N, K/32], w = q * scale."""
    if raw.ggml_type != "Q8_0":
        raise ValueError(f"gguf_blocks_to_int8: expected Q8_0 blocks, got {raw.ggml_type}")
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows, cols // BLOCK, 34)  # [N, K/32, 2 + 32 bytes]
    return _as_torch(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols), _f16(blocks, 0))


class BlockFormat(NamedTuple):
    quant: str                  # the Kiln weight format (runtime.weights.FORMATS)
    group_size: int
    convert: Callable[[RawBlocks], tuple[torch.Tensor, ...]] | None  # -> the format's logical operands, in roles order
    f16_scales: bool            # scales (and zeros or mins) are f16 values, so packed as f16 (K-quants' d * sc
                                # rarely are: f32)


# GGUF block type -> the Kiln weight format that holds it exactly
BLOCK_FORMATS = {
    "Q4_0": BlockFormat("int4", BLOCK, gguf_q4_0_to_int4, True),
    "Q4_1": BlockFormat("int4", BLOCK, gguf_blocks_to_int4, True),
    "Q4_K": BlockFormat("int4", BLOCK, gguf_q4_k_to_int4, False),
    "Q5_0": BlockFormat("int5", BLOCK, gguf_q5_0_to_int5, True),
    "Q5_1": BlockFormat("int5", BLOCK, gguf_q5_1_to_int5, True),
    "Q5_K": BlockFormat("int5", BLOCK, gguf_q5_k_to_int5, False),
    "Q6_K": BlockFormat("int6", 16, gguf_q6_k_to_int6, False),
    "Q8_0": BlockFormat("int8", BLOCK, gguf_blocks_to_int8, True),
}
# Quantized blocks with no exact Kiln format are requantized to this one (group BLOCK, f32 scales) under method
# "source": int8 group-32 holds their values to within 1/254 of each group's range.
REQUANT_SOURCE_FORMAT = "int8"
REQUANTIZED = BlockFormat(REQUANT_SOURCE_FORMAT, BLOCK, None, False)
CODE_BITS = {"int4": 4, "int5": 5, "int6": 6, "int8": 8}


def engine_bytes(ggml_type: str, elements: int) -> float:
    """The bytes a quantized GGUF weight of `elements` takes in a "source" engine, panel padding aside: its
    Kiln format's codes and, per group, a scale (and a zero or min) of 2 or 4 bytes (the planner's price)."""
    block = BLOCK_FORMATS.get(ggml_type, REQUANTIZED)
    per_group = (len(FORMATS[block.quant].roles) - 1) * (2 if block.f16_scales else 4)
    return elements * (CODE_BITS[block.quant] / 8 + per_group / block.group_size)
