"""The experts of a moe node on the cuda backend: one launch runs every (token, chosen expert) pair's projection.

expert_gemv: y[s] = x[row(s)] @ w[expert[s]].T for each slot s of a step's T * top_k (token, expert) pairs, the
experts' weights stacked [E, N, K] in the activation dtype. row(s) is s // top_k for the experts' input projection
(each token's hidden row, read by its top_k slots) and s for the output projection (each slot's own activation).
A slot whose expert is -1 (held by another rank under expert parallelism) writes zeros. Program (n, s) owns BLOCK_N
outputs of slot s and walks K, accumulating in f32: a slot reads only its own expert's weights, and everything is
decided on the device (no host synchronisation), so decode steps with experts replay as CUDA graphs.

Each slot reads its expert's weights itself: at batch 1 that is exactly the chosen experts' weights, once; with
more tokens an expert chosen by several of them is read once per slot (a grouped GEMM over tokens sorted by expert
is the next step for prefill).
"""

import torch
import triton.language as tl

from runtime.backends.cuda.launch import Launcher, cdiv, kernel
from runtime.ops.checks import describe, fail

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_N = 32
BLOCK_K = 64


@kernel(num_warps=4, num_stages=2)
def _expert_gemv(x, experts, w, y, N, K: tl.constexpr, ROWS_PER_X: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Program (n, s): y[s, n*BLOCK_N:(n+1)*BLOCK_N] = x[s // ROWS_PER_X] @ w[experts[s]].T over those rows."""
    slot = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    expert = tl.load(experts + slot).to(tl.int64)
    held = expert >= 0
    reads = tl.where(held, N, 0)  # a slot of another rank's expert reads nothing and writes zeros
    mask_w = offs_n < reads
    base = tl.maximum(expert, 0) * N * K
    row = (slot // ROWS_PER_X).to(tl.int64) * K
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xv = tl.load(x + row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        wv = tl.load(w + base + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                     mask=mask_w[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(y + slot.to(tl.int64) * N + offs_n, acc.to(y.dtype.element_ty), mask=mask_n)


def expert_gemv(launcher: Launcher, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                rows_per_x: int) -> torch.Tensor:
    """y [S, N] in x's dtype: slot s = x[s // rows_per_x] @ weights[experts[s]].T (zeros where experts[s] is -1).

    x [S / rows_per_x, K] contiguous f32/f16/bf16; experts int32 [S]; weights [E, N, K] in x's dtype."""
    fn = "expert_gemv"
    if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES or x.dim() != 2 or not x.is_contiguous():
        fail(fn, f"x must be a contiguous f32/f16/bf16 [rows, K], got {describe(x)}")
    if (not isinstance(weights, torch.Tensor) or weights.dtype != x.dtype or weights.dim() != 3
            or weights.shape[2] != x.shape[1] or not weights.is_contiguous()):
        fail(fn, f"weights must be a contiguous {x.dtype} [E, N, {x.shape[1]}], got {describe(weights)}")
    slots = x.shape[0] * rows_per_x
    if (not isinstance(experts, torch.Tensor) or experts.dtype != torch.int32 or tuple(experts.shape) != (slots,)
            or not experts.is_contiguous()):
        fail(fn, f"experts must be a contiguous int32 [{slots}], got {describe(experts)}")
    n, k = weights.shape[1], weights.shape[2]
    y = torch.empty((slots, n), dtype=x.dtype, device=x.device)
    if slots:
        launcher.launch(_expert_gemv, (cdiv(n, BLOCK_N), slots), (x, experts, weights, y, n),
                        K=k, ROWS_PER_X=rows_per_x, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
