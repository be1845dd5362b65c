"""Native CPU kernels (C over the buffer protocol): _attention for paged attention, _qlinear for quantized
linears, _ops for row-wise ops and the step tapes that record and replay calls of all three.

_ops is imported first: the other two find its tape state when they are imported."""

from runtime._native import _ops  # noqa: F401
