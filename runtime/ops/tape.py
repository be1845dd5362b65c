"""Step tapes: record every C kernel call of a step (`Recording`) and replay them; the output buffers they reuse.

A bound op marked `recordable` does all its work in C calls a tape records; one that had to take another
path calls `unrecorded()`. `Outputs` keeps a node's small outputs from step to step, so a replayed
tape finds its buffers where the recording left them.

A tape recorded with its step's shape (tokens, sequences, logits rows) can replay a step of another shape:
every call's counts are rewritten first from the recorded ones (C's tape_rows): row counts follow the
tokens, or the logits rows on the calls after their gather, and attention's sequence count the sequences.
The buffers must hold the rows, so kept outputs are allocated for REUSE_ROWS rows whatever the step's
count: every tape of an executor shares them, and a step of up to REUSE_ROWS tokens finds its rows where
any tape points. Nodes whose values never live at the same time share one buffer (`Slot`, assigned by
runtime.ops.program.Program from the order of its calls), so that the buffers cost a few values' rows rather
than every node's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from runtime._native import _ops as _C

REUSE_ROWS = 256  # outputs of at most this many rows are kept for reuse: steps of up to this many tokens replay


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

    def __init__(self, tokens: int = 0, seqs: int = 0, logits: int = 0):
        """The step's token, sequence and logits row counts, so that the tape can replay other counts (0: not
        given; without tokens it replays this step's shape only)."""
        self.shape = (tokens, seqs, logits)

    def __enter__(self) -> Recording:
        self.tape = None
        self.recording = self.complete = _C.tape_begin(*self.shape)  # False: another thread records; unrecorded
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


def replay(tape, tokens: int = -1, seqs: int = -1, logits: int = -1) -> None:
    """Run a recorded tape again (the index checks of its calls first; a ValueError if one fails); a count >= 0:
    for a step of that many tokens, sequences or logits rows (a tape recorded with its counts; the buffers must
    hold the rows)."""
    _C.replay(tape, tokens, seqs, logits)


def tape_size(tape) -> int:
    return _C.tape_size(tape)


def tape_tokens(tape) -> int:
    """The token count the tape's calls run now; minus it (or 0) if one of them cannot run another count."""
    return _C.tape_tokens(tape)


class Slot:
    """One buffer of REUSE_ROWS rows that several nodes' outputs take in turn (their lives do not overlap):
    allocated on first use, as wide as the widest of them."""

    def __init__(self):
        self.width, self.buffer = 0, None

    def rows(self, width: int) -> torch.Tensor:
        """The buffer as [REUSE_ROWS, width] (contiguous rows of `width`)."""
        if self.buffer is None:
            self.buffer = torch.empty(REUSE_ROWS * self.width, dtype=torch.float32)
        return self.buffer[:REUSE_ROWS * width].view(REUSE_ROWS, width)


class Outputs:
    """Output buffers of one node, as (tensor, numpy view) pairs shaped like x with new last sizes.

    Fresh per call; with reuse=True, a 2-D output of at most REUSE_ROWS rows is the first rows of one
    buffer of REUSE_ROWS rows per width, kept for the node's life, so that its address is the same
    whatever the step's row count (a tape replays other counts on it), and the views of the last row
    count are kept (decode steps repeat it). A kept output is overwritten when the node runs again, or,
    when Program gave it a Slot, when a later node's output takes the slot: only for runners whose values
    live one step and are read in call order. A binder makes at most one Outputs, whose widths are its
    call's outputs in order (Program checks the first step's values against its slots); Program learns
    which binder made which through `made_by`, per thread, so engines may open side by side.
    """

    def __init__(self, widths: tuple[int, ...], reuse: bool = False):
        self.widths, self.reuse = widths, reuse
        self.rows, self.kept, self.full = -1, (), ()
        self.slots: tuple[Slot, ...] | None = None  # per width, when Program shares the buffers
        made = getattr(_binding, "made", None)
        if reuse and made is not None:
            made.append(self)

    def get(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, object], ...]:
        """Outputs shaped like x (2-D x: rows x.shape[0]) with the node's widths."""
        rows = x.shape[0] if x.dim() == 2 else -1
        if self.reuse and rows == self.rows:
            return self.kept
        if not self.reuse or not 0 <= rows <= REUSE_ROWS:
            return tuple((t, t.numpy()) for t in (x.new_empty(x.shape[:-1] + (w,)) for w in self.widths))
        return self._kept(rows)

    def for_rows(self, rows: int) -> torch.Tensor:
        """The first output, f32 [rows, width] (an embedding's rows of its token ids)."""
        if self.reuse and rows == self.rows:
            return self.kept[0][0]
        if not self.reuse or rows > REUSE_ROWS:
            return torch.empty((rows, self.widths[0]), dtype=torch.float32)
        return self._kept(rows)[0][0]

    def _kept(self, rows: int) -> tuple[tuple[torch.Tensor, object], ...]:
        if not self.full:
            self.full = (tuple(slot.rows(w) for slot, w in zip(self.slots, self.widths)) if self.slots else
                         tuple(torch.empty((REUSE_ROWS, w), dtype=torch.float32) for w in self.widths))
        self.rows, self.kept = rows, tuple((t, t.numpy()) for t in (full[:rows] for full in self.full))
        return self.kept


_binding = threading.local()  # .made: while this thread binds a node (`made_by`), the reusing Outputs made


@contextlib.contextmanager
def made_by() -> Iterator[list[Outputs]]:
    """The reusing Outputs made on this thread inside the block (Program binds a node in one)."""
    outer, _binding.made = getattr(_binding, "made", None), []
    try:
        yield _binding.made
    finally:
        _binding.made = outer
