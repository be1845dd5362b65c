"""Argument checks shared by the C kernel wrappers: one-line ValueErrors naming the function and the argument,
and the numpy views through which tensors reach the C side's buffer protocol."""

from __future__ import annotations

import torch

# dtypes numpy cannot hold (or the C side reads as raw 16-bit words), viewed as same-width integers
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def fail(fn: str, msg: str) -> None:
    raise ValueError(f"{fn}: {msg}")


def expect_shape(fn: str, name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    """Raise ValueError unless t is a CPU tensor of exactly dtype and shape."""
    if not isinstance(t, torch.Tensor):
        fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device.type != "cpu":
        fail(fn, f"{name} must be {dtype} {tuple(shape)} on cpu, got {t.dtype} {tuple(t.shape)} on {t.device}")


def expect_contiguous(fn: str, name: str, t, dtype: torch.dtype, ndim: int, layout: str, shape=None) -> None:
    """Raise ValueError unless t is a contiguous CPU tensor of dtype with ndim dims (and shape if given)."""
    ok = (isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == ndim and t.is_contiguous()
          and t.is_cpu and (shape is None or t.shape == shape))
    if not ok:
        expected = f"{tuple(shape)} " if shape is not None else ""
        fail(fn, f"{name} must be {dtype_name(dtype)} contiguous CPU {layout} {expected}got {describe(t)}")


def describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{dtype_name(t.dtype)} {tuple(t.shape)} {layout} on {t.device}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def buffer(t: torch.Tensor | None):
    """A numpy view of t's memory, which exposes the buffer protocol (tensors do not); None stays None."""
    if t is None:
        return None
    view = _NUMPY_VIEW.get(t.dtype)
    return (t.view(view) if view is not None else t).detach().numpy()


def threads(num_threads: int | None = None) -> int:
    """The threads a kernel call asks for (and a step tape records): its own argument, else torch's count.
    The C side runs on fewer while runtime.backends.cpu.cpus.ThreadGovernor caps them."""
    return torch.get_num_threads() if num_threads is None else int(num_threads)
