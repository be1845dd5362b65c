"""Row-wise ops in C (_native._ops): rms_norm, add + rms_norm, silu(gate) * up, gelu_tanh(gate) * up,
add, x * factor, gather_rows.

Same math as the torch references in runtime.ops.reference (what the tests compare against), in
one call instead of 3-6 dispatched torch ops: for the few rows of a decode step the dispatch is
most of the cost. Inputs must be float32 CPU tensors of the right width (a ValueError naming the
argument otherwise) and contiguous (a strided one cannot be exported as a buffer: ValueError before
anything runs). Each `bind_*` is recordable on a step tape (runtime.ops.tape).
"""

from __future__ import annotations

import torch

from runtime._native import _ops as _C
from runtime.ops.checks import threads
from runtime.ops.tape import Outputs, recordable, unrecorded


def _f32(fn: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be a contiguous float32 CPU tensor, got {t.dtype} "
                         f"{tuple(t.shape)} {'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps)."""
    return bind_rms_norm(weight, eps)(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    return bind_add_rms_norm(weight, eps)(x, residual)


def silu_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up of the fused projection [..., 2n] = gate | up -> [..., n]; act "silu" or "gelu_tanh"."""
    _f32("silu_mul", "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must end in an even size (gate | up)")
    return bind_silu_mul(gate_up.shape[-1] // 2, act=act)(gate_up)


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x *= factor in place (factor rounded to float32, as torch's x * factor rounds it); returns x."""
    return bind_scale(factor)(x)


# The executor's per-step calls: the weight is checked and taken once; a call checks what the C side
# cannot see (dtype, the last dimension) and leaves contiguity and sizes to the buffer protocol and
# the C length checks, which raise before any data is read.

def bind_rms_norm(weight: torch.Tensor, eps: float, reuse: bool = False):
    w, n = _weight("rms_norm", weight), weight.numel()
    outputs = Outputs((n,), reuse)

    def run(x: torch.Tensor) -> torch.Tensor:
        _rows("rms_norm", "x", x, n)
        (out, out_np), = outputs.get(x)
        _C.rms_norm(out_np, x.numpy(), w, eps, threads())
        return out

    return recordable(run)


def bind_add_rms_norm(weight: torch.Tensor, eps: float, reuse: bool = False):
    w, n = _weight("add_rms_norm", weight), weight.numel()
    outputs = Outputs((n, n), reuse)

    def run(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _rows("add_rms_norm", "x", x, n)
        if residual.shape != x.shape or residual.dtype != torch.float32:
            raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must be float32 "
                             f"of the shape of x {tuple(x.shape)}")
        (out, out_np), (total, total_np) = outputs.get(x)
        _C.add_rms_norm(out_np, total_np, x.numpy(), residual.numpy(), w, eps, threads())
        return out, total

    return recordable(run)


# act of a gated activation (the silu_mul node's attribute) -> its kernel
GATED_ACTS = {"silu": _C.silu_mul, "gelu_tanh": _C.gelu_tanh_mul}


def bind_silu_mul(n: int, reuse: bool = False, act: str = "silu"):
    """act(gate) * up of gate_up [..., 2n] -> [..., n], act one of GATED_ACTS."""
    if act not in GATED_ACTS:
        raise ValueError(f"silu_mul: act must be one of {sorted(GATED_ACTS)}, got {act!r}")
    kernel, outputs = GATED_ACTS[act], Outputs((n,), reuse)

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        _rows("silu_mul", "gate_up", gate_up, 2 * n)
        (out, out_np), = outputs.get(gate_up)
        kernel(out_np, gate_up.numpy(), n, threads())
        return out

    return recordable(run)


def bind_scale(factor: float):
    """x *= factor in place, for a float32 x the caller made (the embedding's rows, scaled by Gemma)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        x_np = _f32("scale", "x", x).numpy()
        _C.scale(x_np, x_np, factor, x.shape[-1] if x.dim() else 0)
        return x

    return recordable(run)


def bind_add(reuse: bool = False):
    """x + y of float32 tensors of one shape in C; other operands go to torch.add (not recorded)."""
    outputs = None

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal outputs
        if (x.shape != y.shape or x.dtype != torch.float32 or y.dtype != torch.float32 or x.dim() != 2
                or not x.is_contiguous() or not y.is_contiguous()):
            unrecorded()
            return torch.add(x, y)
        if outputs is None or outputs.widths != (x.shape[1],):
            outputs = Outputs((x.shape[1],), reuse)
        (out, out_np), = outputs.get(x)
        _C.add(out_np, x.numpy(), y.numpy(), x.shape[1])
        return out

    return recordable(run)


def gather_rows(x: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None,
                logits: bool = False) -> torch.Tensor:
    """x[indices] for float32 x [rows, n] and int64 indices [R] (checked: a ValueError if one is outside x), into
    out (f32 [R, n], contiguous) if given. logits: the gather of a step's logits rows, which a tape's later calls
    run on (runtime/ops/tape.py)."""
    x = _f32("gather_rows", "x", x)
    if indices.dtype != torch.int64 or indices.dim() != 1 or not indices.is_contiguous() or x.dim() != 2:
        raise ValueError(f"gather_rows: needs x [rows, n] and contiguous int64 indices [R], got x {tuple(x.shape)}, "
                         f"indices {indices.dtype} {tuple(indices.shape)}")
    if out is None:
        out = x.new_empty((indices.shape[0], x.shape[1]))
    if out.numel():
        _C.gather_rows(out.numpy(), x.numpy(), indices.numpy(), x.shape[1], logits)
    return out


def _weight(fn: str, weight: torch.Tensor):
    return _f32(fn, "weight", weight).numpy()


def _rows(fn: str, name: str, x: torch.Tensor, n: int) -> None:
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"{fn}: {name} must be float32 [..., {n}], got {x.dtype} {tuple(x.shape)}")
