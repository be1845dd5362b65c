"""Native CPU kernels (C over the buffer protocol): _attention for paged attention, _qlinear for quantized
linears, _ops for row-wise ops and the step tapes that record and replay calls of all three.

_ops is imported first: the other two find its tape state when they are imported."""

from runtime._native import _ops


def required_cpu_flags() -> list[str]:
    """The /proc/cpuinfo flags the compiled kernels require: each module's REQUIRED_CPU_FLAGS (derived in C
    from the compile options), in order, without repeats. A CPU engine's manifest records them."""
    # Imported here, not above: their init looks up _ops' tape state through this package, which
    # must have finished importing by then.
    from runtime._native import _attention, _qlinear

    flags: list[str] = []
    for module in (_ops, _attention, _qlinear):
        flags += [flag for flag in module.REQUIRED_CPU_FLAGS if flag not in flags]
    return flags
