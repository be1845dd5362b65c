"""Step tapes: record every C kernel call of a step (`Recording`) and replay them; the output buffers they reuse.

A bound op marked `recordable` does all its work in C calls a tape records; one that had to take another
path calls `unrecorded()`. `Outputs` keeps a node's small outputs from step to step, so a replayed
tape finds its buffers where the recording left them.
"""

from __future__ import annotations

import torch

from runtime._native import _ops as _C

REUSE_ROWS = 64  # outputs of at most this many rows are kept for reuse (decode and small batches)


def recordable(fn):
    """Marks a bound op whose every call does all its work in C calls a tape records (see Recording)."""
    fn.recordable = True
    return fn


class Recording:
    """Records every Kiln C kernel call made inside the `with` block into a tape (`self.tape`).

    A replay (`replay(tape)`) runs the same calls on the same buffers, so the caller must keep every
    buffer the calls touched alive and unmoved, and write a new step's inputs into them in place.
    A recordable op that had to take another path (a copy, a torch op) calls `unrecorded()`; the
    tape is then None, as it is when the block raises.
    """

    active: Recording | None = None

    def __enter__(self) -> Recording:
        self.tape = None
        self.recording = self.complete = _C.tape_begin()  # False: another thread records; run unrecorded
        if self.recording:
            Recording.active = self
        return self

    def __exit__(self, kind, *_) -> None:
        if self.recording:
            Recording.active = None
            tape = _C.tape_end()
            self.tape = tape if kind is None and self.complete else None


def unrecorded() -> None:
    """Called by a recordable op that did work outside its C call: a tape recording now is incomplete."""
    if Recording.active is not None:
        Recording.active.complete = False


def replay(tape) -> None:
    """Run a recorded tape again (the index checks of its calls first; a ValueError if one fails)."""
    _C.replay(tape)


def tape_size(tape) -> int:
    return _C.tape_size(tape)


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
