"""Quantization tensor math, apart from any graph: quantize/dequantize INT8, INT4, FP8 and the AWQ searches.

Logical formats (the IR's "logical" layout; runtime/qlinear.py packs them for the kernels):
  int8  symmetric:   w[n,k] = q[n,k] * scale[n]                  (or scale[n, k//G] with a group size)
  int4  zero points: w[n,k] = (q[n,k] - 8) * scale[n, k//G] + zero[n, k//G],   q in 0..15
  fp8   e4m3:        w[n,k] = e4m3(q[n,k]) * scale[n]             (per channel, or one scale per tensor)
Every `quantize_*` returns `Quantized(q, scales, zeros, error)`, error being the relative RMS
reconstruction error ||w - dequantize(q)|| / ||w||.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

INT8_MAX = 127
INT4_LEVELS = 15
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Quantized(NamedTuple):
    q: torch.Tensor              # int8 | uint8 (0..15) | float8_e4m3fn, [N, K]
    scales: torch.Tensor         # f32 [N], [1] (fp8 per tensor) or [N, K/G]
    zeros: torch.Tensor | None   # f32 [N, K/G] for int4
    error: float                 # relative RMS reconstruction error


def relative_error(w: torch.Tensor, approx: torch.Tensor) -> float:
    norm = w.double().norm()
    return float((w.double() - approx.double()).norm() / norm) if norm > 0 else 0.0


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    return w.float().reshape(n, k // group_size, group_size)  # [N, K/G, G]


def _expand(s: torch.Tensor, k: int) -> torch.Tensor:
    """Scales [N], [1] or [N, K/G] as float64 [N or 1, K]."""
    s = s.double().reshape(s.shape[0], -1)
    return s.repeat_interleave(k // s.shape[1], dim=1)


def _safe(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row or group stays zero


# ------------------------------------------------------------------------------------------ int8

def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> Quantized:
    """Symmetric INT8: scale = max|w| / 127 per output channel (or per group of `group_size` inputs)."""
    blocks = _groups(w, group_size or w.shape[1])
    scales = blocks.abs().amax(-1) / INT8_MAX  # [N, K/G]
    q = torch.round(blocks / _safe(scales)[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    q = q.reshape(w.shape)
    scales = scales if group_size else scales[:, 0]
    return Quantized(q, scales, None, relative_error(w, dequantize_int8(q, scales)))


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.double() * _expand(scales, q.shape[1])).float()


# ------------------------------------------------------------------------------------------ int4

def quantize_int4(w: torch.Tensor, group_size: int) -> Quantized:
    """Group-wise asymmetric INT4 (round to nearest): each group's [min, max] spread over 16 levels."""
    blocks = _groups(w, group_size)
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K/G]
    scales = (hi - lo) / INT4_LEVELS
    q = torch.round((blocks - lo[..., None]) / _safe(scales)[..., None]).clamp(0, INT4_LEVELS)
    q = q.to(torch.uint8).reshape(w.shape)
    zeros = lo + 8 * scales  # w = q * scale + lo = (q - 8) * scale + zero
    return Quantized(q, scales, zeros, relative_error(w, dequantize_int4(q, scales, zeros)))


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    return ((q.double() - 8) * _expand(scales, k) + _expand(zeros, k)).float()


# ------------------------------------------------------------------------------------------ fp8

def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> Quantized:
    """FP8 e4m3 with scale = max|w| / 448 per output channel, or one scale for the whole tensor."""
    w = w.float()
    amax = w.abs().amax(1) if per_channel else w.abs().amax().reshape(1)
    scales = amax / FP8_MAX  # [N] or [1]
    scaled = w / _safe(scales)[:, None] if per_channel else w / _safe(scales)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Quantized(q, scales, None, relative_error(w, dequantize_fp8(q, scales)))


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.double() * scales.double().reshape(-1, 1)).float()


def fake_quantize(w: torch.Tensor, quant: str, group_size: int | None) -> torch.Tensor:
    """quantize then dequantize: the float weights a scheme ends up computing with (int4: in float32,
    equal to dequantize_int4(quantize_int4(w)) up to float32 rounding, and a few times faster)."""
    if quant == "int4":
        return _fake_int4_rows(_groups(w, group_size)).reshape(w.shape)
    if quant == "int8":
        return dequantize_int8(*quantize_int8(w, group_size)[:2])
    if quant == "fp8":
        return dequantize_fp8(*quantize_fp8(w)[:2])
    raise ValueError(f"unknown quantization {quant!r}")


# ------------------------------------------------------------------------------------------ AWQ

class AWQScales(NamedTuple):
    scales: torch.Tensor   # f32 [C]: multiply weight input channels by scales[channel_map], divide the producer
    alpha: float           # the chosen exponent; 0 means plain round-to-nearest won
    error: float           # mean squared output error with these scales
    error_rtn: float       # the same without scaling (alpha = 0)


def awq_search(x: torch.Tensor, weights: list[torch.Tensor], fake_quant: Callable[[torch.Tensor], torch.Tensor],
               grid: int = 20, channel_map: torch.Tensor | None = None, loss_rows: int = 512) -> AWQScales:
    """Activation-aware scales for linears sharing the input x [T, K] (Lin et al., AWQ, 2023).

    For alpha on a grid of step 1/grid in [0, 1): s = mean|x|^alpha, normalised so that
    sqrt(max(s) * min(s)) = 1; the error is || x W^T - (x / s) Q(W * s)^T ||^2 summed over
    `weights`, on `loss_rows` evenly spaced rows of x. The grid is searched coarse to fine (every
    other point, then the two neighbours of the best), which finds the same minimum when the error
    is unimodal in alpha, in 12 evaluations instead of 20. `channel_map` [K] ties input channels
    to C shared scales (a grouped-query o_proj whose scales fold into v_proj's rows).
    """
    x = x.float()
    k = x.shape[1]
    channel_map = torch.arange(k) if channel_map is None else channel_map
    channels = int(channel_map.max()) + 1
    counts = torch.zeros(channels).index_add_(0, channel_map, torch.ones(k))
    stat = torch.zeros(channels).index_add_(0, channel_map, x.abs().mean(0)) / counts  # [C]
    x = x[:: max(1, -(-x.shape[0] // loss_rows))]
    w_all = torch.cat([w.float() for w in weights])  # [sum N, K]
    reference = x @ w_all.T
    errors: dict[int, tuple[float, torch.Tensor]] = {}

    def error_at(i: int) -> float:
        if i not in errors:
            s = stat.pow(i / grid).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            full = s[channel_map]
            approx = (x / full) @ fake_quant(w_all * full).T
            errors[i] = (float((reference - approx).pow(2).mean()), s)
        return errors[i][0]

    coarse = min(range(0, grid, 2), key=error_at)
    best = min((i for i in (coarse - 1, coarse, coarse + 1) if 0 <= i < grid), key=error_at)
    return AWQScales(errors[best][1], best / grid, errors[best][0], error_at(0))


def awq_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, grid: int = 20, max_shrink: float = 0.5,
             rows: int = 256) -> torch.Tensor:
    """w [N, K] with each (output channel, group) clipped to +-(1 - i/grid) max|w|, i < max_shrink * grid,
    whichever gives that group's INT4 partial outputs x_g w_g^T the least squared error on `rows`
    evenly spaced rows of x [T, K] (AWQ's weight clipping search; round to nearest cannot clip)."""
    n, k = w.shape
    groups = k // group_size
    x = x.float()[:: max(1, -(-x.shape[0] // rows))]
    xg = x.reshape(-1, groups, group_size).permute(1, 2, 0).contiguous()     # [K/G, G, T]
    wg = w.float().reshape(n, groups, group_size).transpose(0, 1).contiguous()  # [K/G, N, G]
    reference = wg @ xg                                                       # [K/G, N, T]
    amax = wg.abs().amax(-1, keepdim=True)                                    # [K/G, N, 1]
    best_error = torch.full(amax.shape, float("inf"))
    best_max = amax
    for i in range(int(max_shrink * grid)):
        limit = amax * (1 - i / grid)
        q = _fake_int4_rows(torch.clamp(wg, -limit, limit))
        error = (q @ xg).sub_(reference).pow_(2).mean(-1, keepdim=True)
        better = error < best_error
        best_error, best_max = torch.where(better, error, best_error), torch.where(better, limit, best_max)
    return torch.clamp(wg, -best_max, best_max).transpose(0, 1).reshape(n, k).contiguous()


def _fake_int4_rows(w: torch.Tensor) -> torch.Tensor:
    """fake_quantize "int4" with one group per row of the last dimension."""
    lo = w.amin(-1, keepdim=True)
    scales = (w.amax(-1, keepdim=True) - lo) / INT4_LEVELS
    return (w - lo).div_(_safe(scales)).round_().clamp_(0, INT4_LEVELS).mul_(scales).add_(lo)


# ------------------------------------------------------------------------------------------ GPTQ

GRID_SHRINKS = (1.0, 0.9, 0.8, 0.7, 0.6)


def fit_int4_grid(w: torch.Tensor, importance: torch.Tensor, group_size: int, shrinks=GRID_SHRINKS,
                  iterations: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's INT4 grid (scales, lo) [N, K/G] fitted to w [N, K] with inputs weighted by
    `importance` [K] (the mean squared activation of each input channel).

    From every start [min * a, max * b] with a, b in `shrinks`, alternate rounding to the grid and
    a weighted least-squares fit of (scale, lo) to the rounded codes, and keep the start whose
    weighted error sum_k importance_k (w_k - (q_k scale + lo))^2 ends lowest. A group already on a
    16-level grid (a Q4_1 block) is fitted exactly from the first start and keeps it.
    """
    blocks = _groups(w, group_size)                                          # [N, K/G, G]
    weights = importance.float().reshape(1, -1, group_size).expand_as(blocks)
    total = weights.sum(-1, keepdim=True)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    best = None
    for a in shrinks:
        for b in shrinks:
            lo = low * a
            scale = ((high * b - lo) / INT4_LEVELS).clamp(min=1e-12)
            for _ in range(iterations):
                q = torch.round((blocks - lo) / scale).clamp_(0, INT4_LEVELS)
                wq, wqq = (weights * q).sum(-1, keepdim=True), (weights * q * q).sum(-1, keepdim=True)
                ww, wqw = (weights * blocks).sum(-1, keepdim=True), (weights * q * blocks).sum(-1, keepdim=True)
                det = wqq * total - wq * wq
                solvable = det > 1e-12 * wqq * total
                fitted = (wqw * total - wq * ww) / torch.where(solvable, det, torch.ones_like(det))
                solvable &= fitted > 0
                scale = torch.where(solvable, fitted, scale)
                lo = torch.where(solvable, (ww - scale * wq) / total.clamp(min=1e-30), lo)
            q = torch.round((blocks - lo) / scale).clamp_(0, INT4_LEVELS)
            error = (weights * (blocks - (q * scale + lo)) ** 2).sum(-1, keepdim=True)
            if best is None:
                best = [scale, lo, error]
            else:
                better = error < best[2]
                best = [torch.where(better, new, old) for new, old in zip((scale, lo, error), best)]
    scale, lo = best[0][..., 0], best[1][..., 0]
    flat = high[..., 0] == low[..., 0]                                      # a constant group: its value, scale 0
    return torch.where(flat, torch.zeros_like(scale), scale), torch.where(flat, low[..., 0], lo)


def gptq_int4(w: torch.Tensor, x: torch.Tensor, group_size: int, grid: tuple[torch.Tensor, torch.Tensor] | None = None,
              damp: float = 1.0, block: int = 128) -> Quantized:
    """Group-wise INT4 of w [N, K] whose rounding errors are compensated on the inputs x [T, K]
    (Frantar et al., GPTQ, 2022): columns are rounded one at a time, most active input first, and each
    column's error is spread over the columns not yet rounded, weighted by the inverse Hessian of
    ||x w^T - x q^T||^2, so the output error stays small where plain rounding's would add up.

    Each group's grid (scales, lo) [N, K/G] is fixed beforehand: `grid` (fit_int4_grid's), else
    w's own [min, max] as quantize_int4 sets it. `damp` (a fraction of the mean diagonal added to
    the Hessian) keeps it invertible and the compensation from fitting the calibration text alone.
    """
    n, k = w.shape
    if grid is None:
        blocks = _groups(w, group_size)
        lo = blocks.amin(-1)
        scales = (blocks.amax(-1) - lo) / INT4_LEVELS                     # [N, K/G]
    else:
        scales, lo = grid
    x = x.double()
    h = x.T @ x / max(1, x.shape[0])
    diagonal = h.diagonal()
    diagonal[diagonal == 0] = 1.0                                          # an input never active
    diagonal += damp * float(diagonal.mean())
    order = torch.argsort(diagonal, descending=True, stable=True)
    h = h[order][:, order]
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    # Rows of `work` are w's columns in rounding order, so each step reads contiguous memory.
    work = w.float().T[order].contiguous()                                 # [K, N]
    group_of = order // group_size
    step, base = scales.T[group_of].contiguous(), lo.T[group_of].contiguous()  # [K, N]
    divisor = _safe(step)
    codes = torch.empty(k, n)
    for start in range(0, k, block):
        end = min(start + block, k)
        part, errors = work[start:end], torch.empty(end - start, n)
        for j in range(end - start):
            c = start + j
            code = torch.round((part[j] - base[c]) / divisor[c]).clamp_(0, INT4_LEVELS)
            codes[c] = code
            errors[j] = (part[j] - (code * step[c] + base[c])) / upper[c, c]
            part[j:] -= upper[c, c:end, None] * errors[j]
        work[end:] -= upper[start:end, end:].T @ errors
    q = codes[torch.argsort(order)].T.to(torch.uint8).contiguous()
    zeros = lo + 8 * scales
    return Quantized(q, scales, zeros, relative_error(w, dequantize_int4(q, scales, zeros)))
