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


def _last_dim(fn: str, name: str, t: torch.Tensor, size: int) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{fn}: {name} {tuple(t.shape)} must end in {size}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps)."""
    _f32("rms_norm", "x", x), _f32("rms_norm", "weight", weight)
    _last_dim("rms_norm", "x", x, weight.numel())
    out = torch.empty_like(x)
    _C.rms_norm(out.numpy(), x.numpy(), weight.numpy(), eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    fn = "add_rms_norm"
    _f32(fn, "x", x), _f32(fn, "residual", residual), _f32(fn, "weight", weight)
    _last_dim(fn, "x", x, weight.numel())
    if residual.shape != x.shape:
        raise ValueError(f"{fn}: residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    out, total = torch.empty_like(x), torch.empty_like(x)
    _C.add_rms_norm(out.numpy(), total.numpy(), x.numpy(), residual.numpy(), weight.numpy(), eps,
                    torch.get_num_threads())
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection [..., 2n] = gate | up -> [..., n]."""
    _f32("silu_mul", "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must end in an even size (gate | up)")
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(gate_up.shape[:-1] + (n,))
    _C.silu_mul(out.numpy(), gate_up.numpy(), n, torch.get_num_threads())
    return out
