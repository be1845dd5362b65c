"""Row-wise ops in C (_native._ops): rms_norm, add + rms_norm, silu(gate) * up.

Same math as the torch versions in runtime.kernels (the reference the tests compare against),
in one call instead of 3-6 dispatched torch ops: for the few rows of a decode step the dispatch
is most of the cost. Inputs must be float32, contiguous and on the CPU; anything else is a
ValueError naming the argument.
"""

from __future__ import annotations

import torch

from runtime._native import _ops as _C


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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection [..., 2n] = gate | up -> [..., n]."""
    _f32("silu_mul", "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must end in an even size (gate | up)")
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(gate_up.shape[:-1] + (n,))
    _C.silu_mul(out.numpy(), gate_up.numpy(), n, torch.get_num_threads())
    return out


# The executor's per-step calls: the weight is checked and taken once; a call checks what the C side
# cannot see (dtype, the last dimension) and leaves contiguity and sizes to the buffer protocol and
# the C length checks, which raise before any data is read.

def bind_rms_norm(weight: torch.Tensor, eps: float):
    w, n = _weight("rms_norm", weight), weight.numel()

    def run(x: torch.Tensor) -> torch.Tensor:
        _rows("rms_norm", "x", x, n)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _C.rms_norm(out.numpy(), x.numpy(), w, eps, torch.get_num_threads())
        return out

    return run


def bind_add_rms_norm(weight: torch.Tensor, eps: float):
    w, n = _weight("add_rms_norm", weight), weight.numel()

    def run(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _rows("add_rms_norm", "x", x, n)
        if residual.shape != x.shape or residual.dtype != torch.float32:
            raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must be float32 "
                             f"of the shape of x {tuple(x.shape)}")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
        _C.add_rms_norm(out.numpy(), total.numpy(), x.numpy(), residual.numpy(), w, eps, torch.get_num_threads())
        return out, total

    return run


def _weight(fn: str, weight: torch.Tensor):
    return _f32(fn, "weight", weight).numpy()


def _rows(fn: str, name: str, x: torch.Tensor, n: int) -> None:
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"{fn}: {name} must be float32 [..., {n}], got {x.dtype} {tuple(x.shape)}")
