"""The experts of a moe node on the cuda backend: one launch runs every (token, chosen expert) pair's projection.

expert_gemv: y[s] = x[row(s)] @ w[expert[s]].T for each slot s of a step's T * top_k (token, expert) pairs, the
experts' weights stacked by expert (Experts). row(s) is s // top_k for the experts' input projection (each
token's hidden row, read by its top_k slots) and s for the output projection (each slot's own activation). A
slot whose expert is -1 (held by another rank under expert parallelism) reads nothing and writes zeros.
Program (n, s) owns BLOCK_N outputs of slot s and walks K, accumulating in f32: a slot reads only its own
expert's weights, and everything is decided on the device (no host synchronisation), so decode steps with
experts replay as CUDA graphs.

Weights are float (the activations' dtype), INT4 (gemm.py's layout: codes two a byte [E, N, K/2], f32 scales and
zeros [E, N, K/G]; w = (q - 8) * scale + zero) or FP8 (e4m3 codes [E, N, K], an f32 scale per output channel
[E, N]), decoded in f32 as gemm.py's GEMVs decode them.

Each slot reads its expert's weights itself: at batch 1 that is exactly the chosen experts' weights, once; with
more tokens an expert chosen by several of them is read once per slot (a grouped GEMM over tokens sorted by expert
is the next step for prefill).
"""

from dataclasses import dataclass

import torch
import triton.language as tl

from runtime.backends.cuda.kernels.gemm import GROUP_SIZES
from runtime.backends.cuda.launch import Launcher, cdiv, kernel
from runtime.ops.checks import describe, fail

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FORMATS = {"float": 0, "int4": 1, "fp8": 2}
BLOCK_N = 32
BLOCK_K = 64


@dataclass(frozen=True)
class Experts:
    """One projection of every held expert, stacked: format "float" (weight [E, N, K] in the activations' dtype),
    "int4" (weight uint8 [E, N, K/2], scales and zeros f32 [E, N, K/group]) or "fp8" (weight uint8 e4m3 codes
    [E, N, K], scales f32 [E, N])."""

    format: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group: int = 0

    @property
    def n(self) -> int:
        return self.weight.shape[1]

    @property
    def k(self) -> int:
        return self.weight.shape[2] * (2 if self.format == "int4" else 1)


@kernel(num_warps=4, num_stages=2)
def _expert_gemv(x, experts, w, scales, zeros, y, N, K: tl.constexpr, ROWS_PER_X: tl.constexpr,
                 FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, s): y[s, n*BLOCK_N:(n+1)*BLOCK_N] = x[s // ROWS_PER_X] @ w[experts[s]].T over those rows."""
    slot = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    expert = tl.load(experts + slot).to(tl.int64)
    reads = tl.where(expert >= 0, N, 0)  # a slot of another rank's expert reads nothing and writes zeros
    mask_w = offs_n < reads
    e = tl.maximum(expert, 0)
    rows = offs_n.to(tl.int64)
    x_row = (slot // ROWS_PER_X).to(tl.int64) * K
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    if FORMAT == 1:  # INT4: one group of K a step
        offs_g = tl.arange(0, GROUP)
        shift = (offs_g % 2) * 4  # code k sits in byte k // 2, high nibble when k is odd
        codes = w + e * N * (K // 2) + rows[:, None] * (K // 2)
        groups = e * N * (K // GROUP) + rows * (K // GROUP)
        for g in range(K // GROUP):
            k = g * GROUP + offs_g
            b = tl.load(codes + (k // 2)[None, :], mask=mask_w[:, None], other=0)
            q = ((b.to(tl.int32) >> shift[None, :]) & 15).to(tl.float32)
            s = tl.load(scales + groups + g, mask=mask_w, other=0.0)
            z = tl.load(zeros + groups + g, mask=mask_w, other=0.0)
            wv = (q - 8.0) * s[:, None] + z[:, None]
            xv = tl.load(x + x_row + k).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
    else:
        base = w + e * N * K + rows[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xv = tl.load(x + x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wv = tl.load(base + offs_k[None, :], mask=mask_w[:, None] & mask_k[None, :], other=0)
            if FORMAT == 2:  # e4m3 codes decoded through f16 bits, as gemm.fp8_gemv: e4m3(b) / 256
                h = wv.to(tl.uint16)
                wv = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)
            acc += tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
        if FORMAT == 2:
            acc *= tl.load(scales + e * N + rows, mask=mask_w, other=0.0) * 256.0
    tl.store(y + slot.to(tl.int64) * N + offs_n, acc.to(y.dtype.element_ty), mask=mask_n)


def expert_gemv(launcher: Launcher, x: torch.Tensor, experts: torch.Tensor, weights: Experts,
                rows_per_x: int) -> torch.Tensor:
    """y [S, N] in x's dtype: slot s = x[s // rows_per_x] @ weights[experts[s]].T (zeros where experts[s] is -1).

    x [S / rows_per_x, K] contiguous f32/f16/bf16; experts int32 [S]."""
    fn = "expert_gemv"
    if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES or x.dim() != 2 or not x.is_contiguous():
        fail(fn, f"x must be a contiguous f32/f16/bf16 [rows, K], got {describe(x)}")
    _check_weights(fn, weights, x)
    slots = x.shape[0] * rows_per_x
    if (not isinstance(experts, torch.Tensor) or experts.dtype != torch.int32 or tuple(experts.shape) != (slots,)
            or not experts.is_contiguous()):
        fail(fn, f"experts must be a contiguous int32 [{slots}], got {describe(experts)}")
    y = torch.empty((slots, weights.n), dtype=x.dtype, device=x.device)
    if slots:
        scales = weights.scales if weights.scales is not None else weights.weight
        zeros = weights.zeros if weights.zeros is not None else scales
        launcher.launch(_expert_gemv, (cdiv(weights.n, BLOCK_N), slots),
                        (x, experts, weights.weight, scales, zeros, y, weights.n),
                        K=weights.k, ROWS_PER_X=rows_per_x, FORMAT=FORMATS[weights.format], GROUP=weights.group or 1,
                        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def _check_weights(fn: str, w: Experts, x: torch.Tensor) -> None:
    k = x.shape[1]
    if w.format not in FORMATS:
        fail(fn, f"format must be one of {sorted(FORMATS)}, got {w.format!r}")
    dtype = x.dtype if w.format == "float" else torch.uint8
    width = k // 2 if w.format == "int4" else k
    weight = w.weight
    if (not isinstance(weight, torch.Tensor) or weight.dtype != dtype or weight.dim() != 3
            or weight.shape[2] != width or not weight.is_contiguous()):
        fail(fn, f"{w.format} weights must be a contiguous {dtype} [E, N, {width}], got {describe(weight)}")
    e, n = weight.shape[:2]
    if w.format == "int4":
        if w.group not in GROUP_SIZES or k % w.group:
            fail(fn, f"int4 group must be one of {GROUP_SIZES} and divide K {k}, got {w.group}")
        for name in ("scales", "zeros"):
            t = getattr(w, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (e, n, k // w.group):
                fail(fn, f"int4 {name} must be f32 [{e}, {n}, {k // w.group}], got {describe(t)}")
    if w.format == "fp8" and (not isinstance(w.scales, torch.Tensor) or w.scales.dtype != torch.float32
                              or tuple(w.scales.shape) != (e, n)):
        fail(fn, f"fp8 scales must be f32 [{e}, {n}], got {describe(w.scales)}")
