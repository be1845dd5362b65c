"""Quantized linears of the cuda backend, y [T, N] = x [T, K] @ w.T (+ bias), over INT4 and FP8 weights.

INT4 (runtime.weights.int4): w[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G], the codes packed
two a byte (layout INT4_LAYOUT, pack_int4). FP8 (runtime.weights.fp8): w[n, k] = e4m3(q[n, k]) * scale[n]
(or one scale). Activations are f32, f16 or bf16, the output is in x's dtype, accumulation is f32.

Two kernels a format, picked by T on the host: for T <= GEMV_MAX_T (decode) a GEMV whose programs own
BLOCK_N outputs, walk K and read each weight once for all T rows (CUDA-core FMAs; FP8 has a third for T = 1,
fp8_gemv1, which sums its products once after the K loop rather than at every step); above it a GEMM over
[BLOCK_M, BLOCK_N] tiles that dequantizes the weight tile to x's dtype and calls tl.dot. f32 activations
use IEEE f32 dots (not TF32), so results match a float32 reference. Constexprs depend only on model
constants (K, group size, tiles), never on T, so one variant serves every T on its side of the threshold.
Weight offsets are int64 (an lm_head's N * K can pass 2^31).

FP8 codes travel as uint8 and are decoded with integer ops (works on sm_80, which has no e4m3 type).
linear_fp8(fp8_act=True) quantizes x per token to e4m3 (scale amax / 448) and runs the GEMM's dot in fp8:
sm_89 and newer only. The quantizer rounds in integer arithmetic rather than with a cast because Triton's
interpreter rounds f32 -> e4m3 wrongly (a mantissa carry is lost); the cast of the rounded value is exact.
"""

import torch
import triton.language as tl

from runtime.backends.cuda.launch import Launcher, cdiv, kernel
from runtime.ops.checks import describe, fail
from runtime.weights import int4

INT4_LAYOUT = "q4g.nk2"
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUP_SIZES = (32, 64, 128)
GEMV_MAX_T = 8        # tokens up to which the GEMV runs; past it the weight is cheaper to reuse from tl.dot tiles
GEMV_BLOCK_N = 16     # outputs a GEMV program owns (small, so a decode step has many programs)
GEMV1_BLOCK_N = 16    # outputs of a one-token FP8 GEMV program, which reads up to 256 bytes of each row a step
GEMM_BLOCK_M, GEMM_BLOCK_N = 64, 64


# ------------------------------------------------------------------------------------------ packing

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> uint8 [N, K/2]: byte j holds code 2j in its low nibble, 2j+1 in its high."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        fail("pack_int4", f"q must be uint8 [N, K] with K even, got {describe(q)}")
    if bool((q > 15).any()):
        fail("pack_int4", "q holds codes above 15")
    return int4.pack_nibbles(q)


unpack_int4 = int4.unpack_nibbles  # uint8 [N, K/2] -> the codes uint8 [N, K] that pack_int4 took


# ------------------------------------------------------------------------------------------ int4 kernels

@kernel(num_warps=4, num_stages=2)
def int4_gemv(x, qweight, scales, zeros, bias, y, T, N, K: tl.constexpr, GROUP: tl.constexpr,
              HAS_BIAS: tl.constexpr, MAX_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p: y[:T, p*BLOCK_N:(p+1)*BLOCK_N] for T <= MAX_T; one group of K per step, dequantized in f32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, GROUP)
    shift = (offs_k % 2) * 4  # code k sits in byte k // 2, high nibble when k is odd
    offs_t = tl.arange(0, MAX_T)
    acc = tl.full([MAX_T, BLOCK_N], 0.0, tl.float32)
    for g in range(K // GROUP):
        k = g * GROUP + offs_k
        b = tl.load(qweight + rows[:, None] * (K // 2) + (k // 2)[None, :], mask=mask_n[:, None], other=0)
        q = ((b.to(tl.int32) >> shift[None, :]) & 15).to(tl.float32)
        s = tl.load(scales + rows * (K // GROUP) + g, mask=mask_n, other=0.0)
        z = tl.load(zeros + rows * (K // GROUP) + g, mask=mask_n, other=0.0)
        w = (q - 8.0) * s[:, None] + z[:, None]  # [BLOCK_N, GROUP]
        for t in tl.static_range(MAX_T):
            if t < T:
                xt = tl.load(x + t * K + k).to(tl.float32)
                part = tl.reduce(w * xt[None, :], 1, tl.standard._sum_combine)  # [BLOCK_N]
                acc = tl.where(offs_t[:, None] == t, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = (offs_t[:, None] < T) & mask_n[None, :]
    tl.store(y + offs_t[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y.dtype.element_ty), mask=mask)


@kernel(num_warps=4, num_stages=3)
def int4_gemm(x, qweight, scales, zeros, bias, y, T, N, K: tl.constexpr, GROUP: tl.constexpr,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (m, n): one [BLOCK_M, BLOCK_N] tile of y; one group of K per step, the weight tile dequantized
    in f32 and rounded to x's dtype for tl.dot."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < T, offs_n < N
    x_rows, rows = offs_m.to(tl.int64) * K, offs_n.to(tl.int64)
    offs_k = tl.arange(0, GROUP)
    shift = (offs_k % 2) * 4
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for g in range(K // GROUP):
        k = g * GROUP + offs_k
        a = tl.load(x + x_rows[:, None] + k[None, :], mask=mask_m[:, None], other=0.0)
        b = tl.load(qweight + rows[:, None] * (K // 2) + (k // 2)[None, :], mask=mask_n[:, None], other=0)
        q = ((b.to(tl.int32) >> shift[None, :]) & 15).to(tl.float32)
        s = tl.load(scales + rows * (K // GROUP) + g, mask=mask_n, other=0.0)
        z = tl.load(zeros + rows * (K // GROUP) + g, mask=mask_n, other=0.0)
        w = ((q - 8.0) * s[:, None] + z[:, None]).to(x.dtype.element_ty)  # [BLOCK_N, GROUP]
        if x.dtype.element_ty == tl.float32:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ fp8 kernels
# A code b decodes exactly as the f16 with bits (b & 0x80) << 8 | (b & 0x7F) << 7, which is e4m3(b) / 256
# (e4m3's exponent bias is 7, f16's 15); the 256 joins the scale after the dot.

@kernel(num_warps=4, num_stages=2)
def fp8_gemv(x, qweight, scales, bias, y, T, N, K: tl.constexpr, PER_CHANNEL: tl.constexpr,
             HAS_BIAS: tl.constexpr, MAX_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: y[:T, p*BLOCK_N:(p+1)*BLOCK_N] for T <= MAX_T, the weight decoded to f32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, MAX_T)
    acc = tl.full([MAX_T, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        b = tl.load(qweight + rows[:, None] * K + k[None, :], mask=mask_n[:, None], other=0).to(tl.uint16)
        w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
        for t in tl.static_range(MAX_T):
            if t < T:
                xt = tl.load(x + t * K + k).to(tl.float32)
                part = tl.reduce(w * xt[None, :], 1, tl.standard._sum_combine)  # [BLOCK_N]
                acc = tl.where(offs_t[:, None] == t, acc + part[None, :], acc)
    if PER_CHANNEL:
        acc *= (tl.load(scales + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
    else:
        acc *= tl.load(scales) * 256.0
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = (offs_t[:, None] < T) & mask_n[None, :]
    tl.store(y + offs_t[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y.dtype.element_ty), mask=mask)


@kernel(num_warps=4, num_stages=3)
def fp8_gemv1(x, qweight, scales, bias, y, N, K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token (batch-1 decode): program p owns y[0, p*BLOCK_N:(p+1)*BLOCK_N]. The products gather in a
    [BLOCK_N, BLOCK_K] tile and are summed once after the K loop; fp8_gemv sums every step for every token."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides K: loads along K need no mask
        k = k0 + offs_k
        b = tl.load(qweight + rows[:, None] * K + k[None, :], mask=mask_n[:, None], other=0).to(tl.uint16)
        w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
        acc += w * tl.load(x + k).to(tl.float32)[None, :]
    out = tl.reduce(acc, 1, tl.standard._sum_combine)  # [BLOCK_N]
    if PER_CHANNEL:
        out *= tl.load(scales + offs_n, mask=mask_n, other=0.0) * 256.0
    else:
        out *= tl.load(scales) * 256.0
    if HAS_BIAS:
        out += tl.load(bias + offs_n, mask=mask_n, other=0.0)
    tl.store(y + offs_n, out.to(y.dtype.element_ty), mask=mask_n)


@kernel(num_warps=4, num_stages=3)
def fp8_gemm(x, x_scales, qweight, scales, bias, y, T, N, K: tl.constexpr, PER_CHANNEL: tl.constexpr,
             FP8_ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Program (m, n): one [BLOCK_M, BLOCK_N] tile of y. Weight-only: the weight tile decoded to x's dtype
    (exact for f16/bf16/f32). FP8_ACT: x holds e4m3 codes with per-row x_scales, and the dot runs in fp8."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < T, offs_n < N
    x_rows, rows = offs_m.to(tl.int64) * K, offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x + x_rows[:, None] + k[None, :], mask=mask_m[:, None], other=0.0)
        b = tl.load(qweight + rows[:, None] * K + k[None, :], mask=mask_n[:, None], other=0)
        if FP8_ACT:
            acc = tl.dot(a, tl.trans(b.to(tl.float8e4nv, bitcast=True)), acc)
        else:
            h = b.to(tl.uint16)
            w = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True).to(x.dtype.element_ty)
            if x.dtype.element_ty == tl.float32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    if FP8_ACT:
        acc *= tl.load(x_scales + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        acc *= 256.0
    if PER_CHANNEL:
        acc *= tl.load(scales + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        acc *= tl.load(scales)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y.dtype.element_ty), mask=mask)


@kernel(num_warps=4, num_stages=2)
def fp8_quantize_rows(x, x_q, x_scales, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program row: x_scales[row] = max|x[row]| / 448, x_q[row] = e4m3(x[row] / x_scales[row]) rounded to
    nearest even (in integer arithmetic, see the module doc); a row of zeros gets scale 0 and codes 0."""
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.full([BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        amax = tl.maximum(amax, tl.abs(tl.load(x + row * K + k0 + offs_k).to(tl.float32)))
    # div_rn: Triton's `/` is an approximate division on the GPU; this rounds as torch does
    scale = tl.math.div_rn(tl.reduce(amax, 0, tl.standard._elementwise_max), 448.0)
    tl.store(x_scales + row, scale)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x + row * K + k0 + offs_k).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, divisor), -448.0), 448.0)
        bits = v.to(tl.int32, bitcast=True)
        # normal e4m3 (|v| >= 2^-6): keep 3 of f32's 23 mantissa bits, ties to even, a carry rolls into the exponent
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # subnormal e4m3: a multiple of 2^-9; adding 1.5 * 2^14 rounds v to one (f32's ulp there is 2^-9)
        subnormal = (v + 24576.0) - 24576.0
        r = tl.where(tl.abs(v) < 0.015625, subnormal, normal)
        tl.store(x_q + row * K + k0 + offs_k, r.to(tl.float8e4nv))


# ------------------------------------------------------------------------------------------ host side

def _check_x(fn: str, x) -> int:
    """K, once x is checked."""
    if (not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES or x.dim() != 2
            or not x.is_contiguous()):
        fail(fn, f"x must be a contiguous f32/f16/bf16 [T, K], got {describe(x)}")
    return x.shape[1]


def _output(fn: str, x: torch.Tensor, n: int, bias, out) -> torch.Tensor:
    """The output [T, N] (out, or a new tensor) once bias and out are checked."""
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        fail(fn, f"bias must be a contiguous f32 [{n}], got {describe(bias)}")
    shape = (x.shape[0], n)
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.dtype != x.dtype or tuple(out.shape) != shape or not out.is_contiguous():
        fail(fn, f"out must be a contiguous {x.dtype} {shape}, got {describe(out)}")
    return out


def _expect(fn: str, name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    if (not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape)
            or not t.is_contiguous()):
        fail(fn, f"{name} must be a contiguous {dtype} {tuple(shape)}, got {describe(t)}")


def _block_k(k: int) -> int:
    """The fp8 kernels' K step: no mask along K, and an f32 GEMM's tiles fit sm_89's 99 KiB of shared memory."""
    return next(b for b in (64, 32, 16) if k % b == 0)


def linear_int4(launcher: Launcher, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] in x's dtype = x [T, K] @ w.T + bias, w the INT4 weight: qweight uint8 [N, K/2] (pack_int4),
    scales and zeros f32 [N, K/G]."""
    fn = "linear_int4"
    if group_size not in GROUP_SIZES:
        fail(fn, f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    n, k = qweight.shape[0], _check_x(fn, x)
    if k % group_size:
        fail(fn, f"in_features {k} must be a multiple of group_size {group_size}")
    _expect(fn, "qweight", qweight, torch.uint8, (n, k // 2))
    _expect(fn, "scales", scales, torch.float32, (n, k // group_size))
    _expect(fn, "zeros", zeros, torch.float32, (n, k // group_size))
    y = _output(fn, x, n, bias, out)
    t = x.shape[0]
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, y, t, n)
    common = {"K": k, "GROUP": group_size, "HAS_BIAS": bias is not None}
    if t <= GEMV_MAX_T:
        launcher.launch(int4_gemv, (cdiv(n, GEMV_BLOCK_N),), args, **common, MAX_T=GEMV_MAX_T,
                        BLOCK_N=GEMV_BLOCK_N)
    else:
        launcher.launch(int4_gemm, (cdiv(t, GEMM_BLOCK_M), cdiv(n, GEMM_BLOCK_N)), args, **common,
                        BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N)
    return y


def linear_fp8(launcher: Launcher, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
               fp8_act: bool = False) -> torch.Tensor:
    """y [T, N] in x's dtype = x [T, K] @ w.T + bias, w the FP8 weight: qweight float8_e4m3fn [N, K], scales
    f32 [N] or [1]. fp8_act (sm_89+): above GEMV_MAX_T tokens, x is quantized per token to e4m3 and the dot
    runs in fp8; the GEMV keeps x as it is (decode reads weights, its FLOPs cost nothing)."""
    fn = "linear_fp8"
    n, k = qweight.shape[0], _check_x(fn, x)
    if k % 16:
        fail(fn, f"in_features {k} must be a multiple of 16")
    _expect(fn, "qweight", qweight, torch.float8_e4m3fn, (n, k))
    if scales.numel() not in (1, n):
        fail(fn, f"scales must be f32 [{n}] or [1], got {describe(scales)}")
    _expect(fn, "scales", scales, torch.float32, (scales.numel(),))
    y = _output(fn, x, n, bias, out)
    t, codes, bias_arg = x.shape[0], qweight.view(torch.uint8), bias if bias is not None else scales
    common = {"K": k, "PER_CHANNEL": scales.numel() == n and n > 1, "HAS_BIAS": bias is not None}
    if t == 1:
        launcher.launch(fp8_gemv1, (cdiv(n, GEMV1_BLOCK_N),), (x, codes, scales, bias_arg, y, n), **common,
                        BLOCK_N=GEMV1_BLOCK_N, BLOCK_K=next(b for b in (256, 128, 64, 32, 16) if k % b == 0))
        return y
    if t <= GEMV_MAX_T:
        launcher.launch(fp8_gemv, (cdiv(n, GEMV_BLOCK_N),), (x, codes, scales, bias_arg, y, t, n), **common,
                        MAX_T=GEMV_MAX_T, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=_block_k(k))
        return y
    x_scales = scales
    if fp8_act:
        x_q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
        x_scales = torch.empty((t,), dtype=torch.float32, device=x.device)
        launcher.launch(fp8_quantize_rows, (t,), (x, x_q, x_scales), K=k, BLOCK_K=_block_k(k))
        x = x_q
    launcher.launch(fp8_gemm, (cdiv(t, GEMM_BLOCK_M), cdiv(n, GEMM_BLOCK_N)),
                    (x, x_scales, codes, scales, bias_arg, y, t, n), **common, FP8_ACT=fp8_act,
                    BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=_block_k(k))
    return y
