"""Two more launchers, for checking a cuda engine on a host without its GPU (`engine-build verify`).

- `ReferenceLauncher` runs each kernel's torch reference (kernels/references.py) instead of the kernel: a whole
  model runs through the executor, its program and its host code, in seconds rather than the interpreter's
  minutes. A kernel without a reference runs in Triton's interpreter.
- `CheckingLauncher` does that too, and runs the first launch of every variant in Triton's interpreter as well,
  on copies of the same arguments (their storage copied, so views and strides stay what they were), then compares
  every tensor the two wrote. That first launch is the model's first layer on the step's tokens: each variant is
  checked on real operands, and a kernel that computes something else than its reference fails there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.backends.cuda.kernels.references import reference_of
from runtime.backends.cuda.launch import Grid, InterpreterLauncher, Kernel, KernelError, Launcher

# Largest |kernel - reference| over what the launch wrote, as a share of the largest |reference| there, by the
# dtype it was stored in: the two sum in different orders (f32), and a value near a rounding boundary of a narrow
# dtype may round either way (one step of its mantissa; e4m3 keeps 3 bits).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 0.13}


class KernelMismatch(KernelError):
    """A kernel's interpreted result is not its reference's."""


@dataclass
class ReferenceLauncher(Launcher):
    device: torch.device = torch.device("cpu")
    allowed: set[str] | None = None
    interpreter: InterpreterLauncher = field(default_factory=InterpreterLauncher)

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        v = self._checked(k, grid, args, constexprs)
        if v is None:
            return
        reference = reference_of(k)
        if reference is None:
            self.interpreter.launch(k, grid, args, **constexprs)
        else:
            reference(tuple(grid), *args, **constexprs)


@dataclass
class CheckingLauncher(ReferenceLauncher):
    checked: dict[str, float] = field(default_factory=dict)   # variant key -> largest relative difference

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        v = self._checked(k, grid, args, constexprs)
        if v is None or v.key in self.checked or reference_of(k) is None:
            super().launch(k, grid, args, **constexprs)
            return
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        copies = _copies(args)
        self.interpreter.launch(k, grid, copies, **constexprs)
        reference_of(k)(tuple(grid), *args, **constexprs)
        worst, where = 0.0, ""
        for name, old, ours, theirs in zip(k.arg_names(), before, copies, args):
            if isinstance(ours, torch.Tensor):
                share = _difference(old, ours, theirs)
                if share > worst:
                    worst, where = share, name
                if share > TOLERANCE.get(theirs.dtype, 0.0):
                    raise KernelMismatch(
                        f"kernel {v.name} ({dict(v.constexprs)}) in Triton's interpreter differs from its torch "
                        f"reference: {name} off by {share:.3g} of its largest value (allowed "
                        f"{TOLERANCE.get(theirs.dtype, 0.0):g} for {str(theirs.dtype).removeprefix('torch.')})")
        self.checked[v.key] = worst


def _copies(args: Sequence) -> list:
    """The arguments with every tensor's storage copied once (tensors sharing storage still share it)."""
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            storage = a.untyped_storage()
            copy = storages.setdefault(storage.data_ptr(), storage.clone())
            a = torch.empty(0, dtype=a.dtype).set_(copy, a.storage_offset(), a.size(), a.stride())
        out.append(a)
    return out


def _difference(before: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest |ours - theirs| where either wrote, as a share of the largest |theirs| there (inf where one
    wrote NaN or an infinity and the other did not); integers must be equal (1.0 when not)."""
    if not (ours.dtype.is_floating_point or ours.dtype == torch.float8_e4m3fn):
        return 0.0 if torch.equal(ours, theirs) else 1.0
    old, a, b = before.float(), ours.float(), theirs.float()
    wrote = ~((a == old) | (a.isnan() & old.isnan())) | ~((b == old) | (b.isnan() & old.isnan()))
    if not bool(wrote.any()):
        return 0.0
    a, b = a[wrote], b[wrote]
    if bool((a.isnan() != b.isnan()).any()) or bool(((a.isinf() | b.isinf()) & (a != b)).any()):
        return float("inf")
    finite = b.isfinite()  # an infinity written by both is equal
    scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    diff = float((a[finite] - b[finite]).abs().max()) if bool(finite.any()) else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
