"""GPTQ's calibration (Frantar et al., 2022) for INT4: grids fitted to activations, rounding with error compensation."""

from __future__ import annotations

import torch

from runtime.weights import int4
from runtime.weights.format import Quantized, group_blocks, nonzero_scales, relative_error

GRID_SHRINKS = (1.0, 0.9, 0.8, 0.7, 0.6)
# fit_int4_grid's rows at once, in weights: its work buffers (four of this many f32, 2 MB) stay in the cache,
# where the whole matrix's went to memory in each of its 150 passes (about 2x faster on a 1B's linears here)
FIT_ELEMENTS = 1 << 17


def fit_int4_grid(w: torch.Tensor, importance: torch.Tensor, group_size: int, shrinks=GRID_SHRINKS,
                  iterations: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's INT4 grid (scales, lo) [N, K/G] fitted to w [N, K] with inputs weighted by
    `importance` [K] (the mean squared activation of each input channel).

    From every start [min * a, max * b] with a, b in `shrinks`, alternate rounding to the grid and
    a weighted least-squares fit of (scale, lo) to the rounded codes, and keep the start whose
    weighted error sum_k importance_k (w_k - (q_k scale + lo))^2 ends lowest. A group already on a
    16-level grid (a Q4_1 block) is fitted exactly from the first start and keeps it.
    """
    blocks = group_blocks(w, group_size)                                          # [N, K/G, G]
    rows = max(1, FIT_ELEMENTS // w.shape[1])
    fitted = [_fit_rows(blocks[i:i + rows], importance, group_size, shrinks, iterations)
              for i in range(0, w.shape[0], rows)]
    return torch.cat([scale for scale, _ in fitted]), torch.cat([lo for _, lo in fitted])


def _fit_rows(blocks: torch.Tensor, importance: torch.Tensor, group_size: int, shrinks,
              iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fit_int4_grid of some rows (blocks [rows, K/G, G]): every step is row by row, so rows fitted apart are
    fitted as they would be together."""
    weights = importance.float().reshape(1, -1, group_size).expand_as(blocks)
    total = weights.sum(-1, keepdim=True)
    ww = (weights * blocks).sum(-1, keepdim=True)  # the same for every start and iteration
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    best = None
    q, weighted, product = (torch.empty_like(blocks) for _ in range(3))
    for a in shrinks:
        for b in shrinks:
            lo = low * a
            scale = ((high * b - lo) / int4.LEVELS).clamp(min=1e-12)
            for _ in range(iterations):
                # in place where it computes the same values: (blocks - lo) / scale rounded, weights * q * q as
                # (weights * q) * q, one buffer for the products
                q = torch.sub(blocks, lo, out=q).div_(scale).round_().clamp_(0, int4.LEVELS)
                weighted = torch.mul(weights, q, out=weighted)
                wq = weighted.sum(-1, keepdim=True)
                wqw = torch.mul(weighted, blocks, out=product).sum(-1, keepdim=True)
                wqq = weighted.mul_(q).sum(-1, keepdim=True)
                det = wqq * total - wq * wq
                solvable = det > 1e-12 * wqq * total
                fitted = (wqw * total - wq * ww) / torch.where(solvable, det, torch.ones_like(det))
                solvable &= fitted > 0
                scale = torch.where(solvable, fitted, scale)
                lo = torch.where(solvable, (ww - scale * wq) / total.clamp(min=1e-30), lo)
            q = torch.sub(blocks, lo, out=q).div_(scale).round_().clamp_(0, int4.LEVELS)
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
    w's own [min, max] as int4.quantize sets it. `damp` (a fraction of the mean diagonal added to
    the Hessian) keeps it invertible and the compensation from fitting the calibration text alone.
    """
    n, k = w.shape
    if grid is None:
        blocks = group_blocks(w, group_size)
        lo = blocks.amin(-1)
        scales = (blocks.amax(-1) - lo) / int4.LEVELS                     # [N, K/G]
    else:
        scales, lo = grid
    x = x.double()
    h = (x.T @ x).div_(max(1, x.shape[0]))
    diagonal = h.diagonal()
    diagonal[diagonal == 0] = 1.0                                          # an input never active
    diagonal += damp * float(diagonal.mean())
    order = torch.argsort(diagonal, descending=True, stable=True)
    del diagonal  # a view: it would keep the first h alive
    # one K x K double at a time beside the one being made (for an 8B's down_proj, 1.6 GB each)
    h = h[order]
    h = h[:, order]
    h = torch.linalg.cholesky(h)
    h = torch.cholesky_inverse(h)
    h = torch.linalg.cholesky(h, upper=True)
    upper = h.float()
    del h
    # Rows of `work` are w's columns in rounding order, so each step reads contiguous memory.
    work = w.float().T[order].contiguous()                                 # [K, N]
    group_of = order // group_size
    step, base = scales.T[group_of].contiguous(), lo.T[group_of].contiguous()  # [K, N]
    divisor = nonzero_scales(step)
    codes = torch.empty(k, n)
    for start in range(0, k, block):
        end = min(start + block, k)
        part, errors = work[start:end], torch.empty(end - start, n)
        for j in range(end - start):
            c = start + j
            code = torch.round((part[j] - base[c]) / divisor[c]).clamp_(0, int4.LEVELS)
            codes[c] = code
            errors[j] = (part[j] - (code * step[c] + base[c])) / upper[c, c]
            part[j:] -= upper[c, c:end, None] * errors[j]
        work[end:] -= upper[start:end, end:].T @ errors
    q = codes[torch.argsort(order)].T.to(torch.uint8).contiguous()
    zeros = lo + 8 * scales
    return Quantized(q, scales, zeros, relative_error(w, int4.dequantize(q, scales, zeros)))
