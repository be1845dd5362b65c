"""Row-wise ops in C (_native._ops): rms_norm, add + rms_norm, silu(gate) * up.

Same math as the torch versions in runtime.kernels (the reference the tests compare against),
in one call instead of 3-6 dispatched torch ops: for the few rows of a decode step the dispatch
is most of the cost. Inputs must be float32 CPU tensors of the right width (a ValueError naming
the argument otherwise) and contiguous (a strided one cannot be exported as a buffer: ValueError
before anything runs).
"""

from __future__ import annotations

import torch

from runtime._native import _ops as _C


def _f32(fn: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be a contiguous float32 CPU tensor, got {t.dtype} "
                         f"{tuple(t.shape)} {'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")
    return t


REUSE_ROWS = 64  # outputs of at most this many rows are kept for reuse (decode and small batches)


class Outputs:
    """Output buffers of one node, as (tensor, numpy view) pairs shaped like x with new last sizes.

    Fresh per call; with reuse=True, 2-D outputs of at most REUSE_ROWS rows are kept while the row
    count stays the same (decode steps repeat it), saving the allocation and the numpy view. A kept
    output is overwritten when the node runs again: only for runners whose values live one step.
    """

    def __init__(self, widths: tuple[int, ...], reuse: bool = False):
        self.widths, self.reuse = widths, reuse
        self.rows, self.kept = -1, ()

    def get(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, object], ...]:
        rows = x.shape[0] if x.dim() == 2 else -1
        if self.reuse and rows == self.rows:
            return self.kept
        made = tuple((t, t.numpy()) for t in (x.new_empty(x.shape[:-1] + (w,)) for w in self.widths))
        if self.reuse and 0 <= rows <= REUSE_ROWS:
            self.rows, self.kept = rows, made
        return made


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
    return bind_silu_mul(gate_up.shape[-1] // 2)(gate_up)


# The executor's per-step calls: the weight is checked and taken once; a call checks what the C side
# cannot see (dtype, the last dimension) and leaves contiguity and sizes to the buffer protocol and
# the C length checks, which raise before any data is read.

def bind_rms_norm(weight: torch.Tensor, eps: float, reuse: bool = False):
    w, n = _weight("rms_norm", weight), weight.numel()
    outputs = Outputs((n,), reuse)

    def run(x: torch.Tensor) -> torch.Tensor:
        _rows("rms_norm", "x", x, n)
        (out, out_np), = outputs.get(x)
        _C.rms_norm(out_np, x.numpy(), w, eps, torch.get_num_threads())
        return out

    return run


def bind_add_rms_norm(weight: torch.Tensor, eps: float, reuse: bool = False):
    w, n = _weight("add_rms_norm", weight), weight.numel()
    outputs = Outputs((n, n), reuse)

    def run(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _rows("add_rms_norm", "x", x, n)
        if residual.shape != x.shape or residual.dtype != torch.float32:
            raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must be float32 "
                             f"of the shape of x {tuple(x.shape)}")
        (out, out_np), (total, total_np) = outputs.get(x)
        _C.add_rms_norm(out_np, total_np, x.numpy(), residual.numpy(), w, eps, torch.get_num_threads())
        return out, total

    return run


def bind_silu_mul(n: int, reuse: bool = False):
    """silu_mul of gate_up [..., 2n] -> [..., n]."""
    outputs = Outputs((n,), reuse)

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        _rows("silu_mul", "gate_up", gate_up, 2 * n)
        (out, out_np), = outputs.get(gate_up)
        _C.silu_mul(out_np, gate_up.numpy(), n, torch.get_num_threads())
        return out

    return run


def _weight(fn: str, weight: torch.Tensor):
    return _f32(fn, "weight", weight).numpy()


def _rows(fn: str, name: str, x: torch.Tensor, n: int) -> None:
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"{fn}: {name} must be float32 [..., {n}], got {x.dtype} {tuple(x.shape)}")
