"""AWQ's calibrations (Lin et al., 2023): per-input-channel scales and per-group clipping searched on activations."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from runtime.weights import int4


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
    return clip_groups(w, awq_clip_limits(x, w, group_size, grid, max_shrink, rows))


def awq_clip_limits(x: torch.Tensor, w: torch.Tensor, group_size: int, grid: int = 20, max_shrink: float = 0.5,
                    rows: int = 256) -> torch.Tensor:
    """awq_clip's limits: [K/G, N, 1], each (group, output channel)'s clip (clip_groups applies them)."""
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
        q = int4.fake_quantize_rows(torch.clamp(wg, -limit, limit))
        error = (q @ xg).sub_(reference).pow_(2).mean(-1, keepdim=True)
        better = error < best_error
        best_error, best_max = torch.where(better, error, best_error), torch.where(better, limit, best_max)
    return best_max


def clip_groups(w: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """w [N, K] with each group clipped to +-limits [K/G, N, 1] (awq_clip_limits')."""
    n, k = w.shape
    groups = limits.shape[0]
    wg = w.float().reshape(n, groups, k // groups).transpose(0, 1)
    return torch.clamp(wg, -limits, limits).transpose(0, 1).reshape(n, k).contiguous()
