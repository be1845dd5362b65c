"""Row-wise Triton kernels of the cuda backend: rms_norm, add + rms_norm, per-head rms_norm, rotary
embedding (rotate-half) and the gated activations silu(gate) * up and gelu_tanh(gate) * up.

Each host function takes the launcher first, checks what the kernel cannot (widths, dtypes, unit
column stride) and launches one kernel. Math is float32 inside; results are stored in the
activation's dtype (float32, float16 or bfloat16). Inputs may be column slices of a wider buffer
(row stride > width), so row strides are passed, and row offsets are int64. Constexprs depend only
on model constants (widths, head_dim, block sizes), never on the token count T, so the variants
the build compiles serve decode and prefill alike.
"""

import torch
import triton.language as tl

from runtime.backends.cuda.launch import Launcher, cdiv, kernel, next_power_of_2

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROW_BLOCK = 4096      # most elements of a row one program holds at once; wider rows are walked in chunks
ACT_BLOCK = 1024      # elements of a gated activation's row per program
GATED_ACTS = ("silu", "gelu_tanh")


@kernel(num_warps=4)
def _rms_norm_kernel(x, weight, out, x_stride, out_stride, width, eps, BLOCK: tl.constexpr):
    """Program (row, group): out[row, g*width:(g+1)*width] = weight * x * rsqrt(mean(x^2) + eps).
    One group per row is a plain rms_norm; one group per head is head_rms_norm."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    x_row = x + row * x_stride + group * width
    out_row = out + row * out_stride + group * width
    offs = tl.arange(0, BLOCK)
    squares = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, width, BLOCK):  # one pass when the row fits in BLOCK
        mask = start + offs < width
        v = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        squares += v * v
    rstd = tl.rsqrt(tl.reduce(squares, 0, tl.standard._sum_combine) / width + eps)
    for start in range(0, width, BLOCK):
        mask = start + offs < width
        v = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight + start + offs, mask=mask, other=0.0)
        tl.store(out_row + start + offs, (w * (v * rstd)).to(out.dtype.element_ty), mask=mask)


@kernel(num_warps=4)
def _add_rms_norm_kernel(x, residual, weight, out, total, x_stride, residual_stride, out_stride, total_stride,
                         width, eps, BLOCK: tl.constexpr):
    """Program row: total = x + residual (rounded to the activation dtype, as a separate add would
    store it); out = rms_norm(total)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = x + row * x_stride, residual + row * residual_stride
    out_row, total_row = out + row * out_stride, total + row * total_stride
    offs = tl.arange(0, BLOCK)
    squares = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, width, BLOCK):
        mask = start + offs < width
        a = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(r_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        t = (a + b).to(total.dtype.element_ty)
        tl.store(total_row + start + offs, t, mask=mask)
        t = t.to(tl.float32)
        squares += t * t
    rstd = tl.rsqrt(tl.reduce(squares, 0, tl.standard._sum_combine) / width + eps)
    # Each thread reads back the elements it stored itself (same layout), so no barrier is needed.
    for start in range(0, width, BLOCK):
        mask = start + offs < width
        t = tl.load(total_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight + start + offs, mask=mask, other=0.0)
        tl.store(out_row + start + offs, (w * (t * rstd)).to(out.dtype.element_ty), mask=mask)


@kernel(num_warps=4)
def _rope_kernel(q, k, q_out, k_out, positions, table, q_stride, k_stride, q_out_stride, k_out_stride,
                 NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """Program (row, head): heads 0..NUM_HEADS-1 are q's, the rest k's. With cos, sin the table row
    at the token's position ([cos | sin] of the first half): out = (x1 cos - x2 sin, x2 cos + x1 sin).
    Every element is loaded before any is stored, so out may be the input itself."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < NUM_HEADS:
        src = q + row * q_stride + head * HEAD_DIM
        dst = q_out + row * q_out_stride + head * HEAD_DIM
    else:
        src = k + row * k_stride + (head - NUM_HEADS) * HEAD_DIM
        dst = k_out + row * k_out_stride + (head - NUM_HEADS) * HEAD_DIM
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half  # HALF_BLOCK is half rounded up to a power of 2 (head_dim 96 -> 64)
    pos = tl.load(positions + row).to(tl.int64)
    cos = tl.load(table + pos * HEAD_DIM + offs, mask=mask, other=0.0)
    sin = tl.load(table + pos * HEAD_DIM + half + offs, mask=mask, other=0.0)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half + offs, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@kernel(num_warps=4)
def _gated_act_kernel(gate, up, out, gate_stride, up_stride, out_stride, up_offset, width,
                      ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block): out = act(gate) * up over BLOCK columns. The up half of a fused
    [gate | up] row is reached through up_offset, so the same variant serves both input forms and
    no pointer needs to start at an unaligned column."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_stride + up_offset + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        z = -g
    else:
        # 0.5 g (1 + tanh(y)) = g * sigmoid(2y): no tanh needed, and no cancellation in 1 + tanh(y)
        # for negative g. exp(z) overflowing to inf gives g / inf = -0, as torch does.
        z = -1.5957691216057308 * (g + 0.044715 * g * g * g)  # -2 sqrt(2/pi) (g + 0.044715 g^3)
    out_val = g / (1.0 + tl.exp(z)) * u
    tl.store(out + row * out_stride + cols, out_val.to(out.dtype.element_ty), mask=mask)


# --- host side -------------------------------------------------------------------------------------

def _check_rows(fn: str, name: str, t: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> None:
    """t must be [T, width] with unit column stride, of an activation dtype (or `dtype` when given)."""
    ok_dtype = t.dtype == dtype if dtype is not None else t.dtype in ACTIVATION_DTYPES
    if t.dim() != 2 or t.shape[1] != width or (width > 1 and t.stride(1) != 1) or not ok_dtype:
        raise ValueError(f"{fn}: {name} must be [T, {width}] with unit column stride and dtype "
                         f"{dtype or 'float32/float16/bfloat16'}, got {t.dtype} {tuple(t.shape)} stride {t.stride()}")


def _check_weight(fn: str, weight: torch.Tensor, width: int) -> None:
    if weight.shape != (width,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"{fn}: weight must be a contiguous float32 [{width}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")


def _out(fn: str, x: torch.Tensor, width: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    _check_rows(fn, "out", out, width, x.dtype)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: out has {out.shape[0]} rows, the input {x.shape[0]}")
    return out


def _norm_block(width: int) -> int:
    return min(next_power_of_2(width), ROW_BLOCK)


def rms_norm(launcher: Launcher, x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2, -1) + eps) of x [T, H] with weight float32 [H] -> [T, H]."""
    h = weight.shape[0]
    _check_weight("rms_norm", weight, h)
    _check_rows("rms_norm", "x", x, h)
    out = _out("rms_norm", x, h, out)
    launcher.launch(_rms_norm_kernel, (x.shape[0], 1), (x, weight, out, x.stride(0), out.stride(0), h, float(eps)),
                    BLOCK=_norm_block(h))
    return out


def head_rms_norm(launcher: Launcher, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm of each head of x [T, heads * hd] with weight float32 [hd] (Gemma 3's q/k norms) -> same shape."""
    hd = weight.shape[0]
    _check_weight("head_rms_norm", weight, hd)
    if x.dim() != 2 or x.shape[1] % hd:
        raise ValueError(f"head_rms_norm: x {tuple(x.shape)} must be [T, heads * {hd}]")
    _check_rows("head_rms_norm", "x", x, x.shape[1])
    out = _out("head_rms_norm", x, x.shape[1], out)
    launcher.launch(_rms_norm_kernel, (x.shape[0], x.shape[1] // hd),
                    (x, weight, out, x.stride(0), out.stride(0), hd, float(eps)), BLOCK=_norm_block(hd))
    return out


def add_rms_norm(launcher: Launcher, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) of x, residual [T, H] in one pass -> ([T, H], [T, H])."""
    h = weight.shape[0]
    _check_weight("add_rms_norm", weight, h)
    _check_rows("add_rms_norm", "x", x, h)
    _check_rows("add_rms_norm", "residual", residual, h, x.dtype)
    if residual.shape[0] != x.shape[0]:
        raise ValueError(f"add_rms_norm: residual has {residual.shape[0]} rows, x {x.shape[0]}")
    normed, total = (None, None) if out is None else out
    normed, total = _out("add_rms_norm", x, h, normed), _out("add_rms_norm", x, h, total)
    launcher.launch(_add_rms_norm_kernel, (x.shape[0],),
                    (x, residual, weight, normed, total, x.stride(0), residual.stride(0), normed.stride(0),
                     total.stride(0), h, float(eps)), BLOCK=_norm_block(h))
    return normed, total


def rope(launcher: Launcher, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
         num_heads: int, num_kv_heads: int, head_dim: int,
         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, nh*hd] and k [T, nkv*hd] at positions int32/int64 [T], from
    table float32 [P, hd] (RopeTable.packed: cos | sin of the first half; P > every position). out may
    be (q, k) to rotate in place."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    _check_rows("rope", "q", q, num_heads * head_dim)
    _check_rows("rope", "k", k, num_kv_heads * head_dim, q.dtype)
    t = q.shape[0]
    if k.shape[0] != t or positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope: q, k and positions must have {t} rows and int positions, got k {tuple(k.shape)}, "
                         f"positions {positions.dtype} {tuple(positions.shape)}")
    if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"rope: table must be a contiguous float32 [P, {head_dim}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    q_out, k_out = (None, None) if out is None else out
    q_out, k_out = _out("rope", q, q.shape[1], q_out), _out("rope", k, k.shape[1], k_out)
    positions = positions.contiguous()
    launcher.launch(_rope_kernel, (t, num_heads + num_kv_heads),
                    (q, k, q_out, k_out, positions, table, q.stride(0), k.stride(0), q_out.stride(0),
                     k_out.stride(0)),
                    NUM_HEADS=num_heads, HEAD_DIM=head_dim, HALF_BLOCK=next_power_of_2(head_dim // 2))
    return q_out, k_out


def gated_act(launcher: Launcher, act: str, *xs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up -> [T, I], act "silu" or "gelu_tanh"; xs is one fused [T, 2I] (gate | up) or (gate, up)."""
    if act not in GATED_ACTS:
        raise ValueError(f"gated_act: act must be one of {GATED_ACTS}, got {act!r}")
    if len(xs) == 1:
        fused = xs[0]
        if fused.dim() != 2 or fused.shape[1] % 2:
            raise ValueError(f"gated_act: the fused input {tuple(fused.shape)} must be [T, 2I]")
        width = fused.shape[1] // 2
        _check_rows("gated_act", "gate_up", fused, 2 * width)
        gate, up, up_offset = fused, fused, width
    elif len(xs) == 2:
        gate, up = xs
        width, up_offset = gate.shape[-1], 0
        _check_rows("gated_act", "gate", gate, width)
        _check_rows("gated_act", "up", up, width, gate.dtype)
        if up.shape[0] != gate.shape[0]:
            raise ValueError(f"gated_act: up has {up.shape[0]} rows, gate {gate.shape[0]}")
    else:
        raise ValueError(f"gated_act: takes one fused input or (gate, up), got {len(xs)} tensors")
    out = _out("gated_act", gate, width, out)
    block = min(next_power_of_2(width), ACT_BLOCK)
    launcher.launch(_gated_act_kernel, (gate.shape[0], cdiv(width, block)),
                    (gate, up, out, gate.stride(0), up.stride(0), out.stride(0), up_offset, width),
                    ACT=act, BLOCK=block)
    return out
