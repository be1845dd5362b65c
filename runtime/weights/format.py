"""The WeightFormat record the registry holds, and the tensor math every format shares.

Every format's `quantize` returns `Quantized(q, scales, zeros, error)`, error being the relative RMS
reconstruction error ||w - dequantize(q)|| / ||w|| (NOT_MEASURED with measure=False).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class WeightFormat:
    """How one weight format is stored in an engine and which kernel computes with it."""

    name: str                  # the IR's attrs["quant"]
    layout: str                # the packed layout id the IR records (attrs["layout"])
    kernel: int                # the _qlinear format code
    roles: tuple[str, ...]     # logical operands, in order (empty: no logical form, packed from a float weight)
    integer_activations: bool  # the int8 and int16 activation paths take it
    pack: Callable             # (logical tensors in roles order, group_size) -> packed dict
    check: Callable            # (fn, packed, n, k, group_size) -> (codes, scales, zeros, scales_f16)
    dequantize_packed: Callable  # (packed, n, k, group_size) -> w f32 [N, K]


class Quantized(NamedTuple):
    q: torch.Tensor              # int8 | uint8 (0..15) | float8_e4m3fn, [N, K]
    scales: torch.Tensor         # f32 [N], [1] (fp8 per tensor) or [N, K/G]
    zeros: torch.Tensor | None   # f32 [N, K/G] for int4
    error: float                 # relative RMS reconstruction error


# A format's quantize(..., measure=False): the codes made again when a streaming build reads them, whose error was
# measured the first time (or, for a rank built alone, is read by no measure)
NOT_MEASURED = float("nan")


def relative_error(w: torch.Tensor, approx: torch.Tensor) -> float:
    norm = w.double().norm()
    return float((w.double() - approx.double()).norm() / norm) if norm > 0 else 0.0


def group_blocks(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] as float32 [N, K/G, G]; a ValueError if G does not divide K."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    return w.float().reshape(n, k // group_size, group_size)


def expand_scales(s: torch.Tensor, k: int) -> torch.Tensor:
    """Scales [N], [1] or [N, K/G] as float64 [N or 1, K]."""
    s = s.double().reshape(s.shape[0], -1)
    return s.repeat_interleave(k // s.shape[1], dim=1)


def nonzero_scales(scales: torch.Tensor) -> torch.Tensor:
    """Zero scales replaced by 1, so dividing by them keeps an all-zero row or group zero."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))
