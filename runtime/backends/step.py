"""StepMetadata: the packed tokens of one step and where their K/V lives, built from a ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from runtime.core.scheduler import ScheduledBatch


@dataclass
class StepMetadata:
    token_ids: torch.Tensor        # [T] int64, packed tokens of all sequences in the step
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, KV cache slot of each token
    block_tables: torch.Tensor     # [S, max_blocks] int32, -1 padded
    context_lens: torch.Tensor     # [S] int32, tokens in cache for each seq after this step's write
    query_start_loc: torch.Tensor  # [S+1] int32, offsets of each seq's tokens in T
    logits_indices: torch.Tensor   # [N] int64, indices into T whose logits are needed
    # An engine with full and sliding-window layers (runtime/format/kv_groups.py): the windowed layers' own slots and
    # tables ([T] int64, [S, max_blocks] int32, -1 for blocks given back); None: every layer reads the above.
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    # Host-side shortcuts that build_step_metadata fills (None / -1 when a step is made otherwise): the numpy
    # arrays behind the tensors above, in executor._step_arrays' order, and the largest position.
    host_arrays: list[np.ndarray] | None = field(default=None, repr=False, compare=False)
    max_position: int = -1

    @property
    def groups(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot_mapping, block_tables) of each KV group."""
        first = [(self.slot_mapping, self.block_tables)]
        return first if self.window_block_tables is None else first + [(self.window_slot_mapping,
                                                                         self.window_block_tables)]


def build_step_metadata(batch: ScheduledBatch, block_size: int, num_groups: int = 1) -> StepMetadata:
    """Pack batch.seqs in order: seq s computes tokens num_computed_tokens .. +num_new_tokens[s].

    Call after schedule() and before postprocess() (it reads each sequence's num_computed_tokens).
    logits_indices holds the last packed token of each sequence in batch.sampling_seqs, in order; a
    sequence with speculative guesses computes its last token and then the guesses, and has logits
    at all of them (k + 1 rows). Then the rows of batch.prompt_logprob_rows(), in order.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    for i, (seq, n, needs_token) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.needs_token)):
        start, guesses = seq.num_computed_tokens, batch.guesses(i)
        token_ids.extend(seq.token_ids[start:start + n - len(guesses)])
        token_ids.extend(guesses)
        positions.extend(range(start, start + n))
        context_lens.append(start + n)
        query_start_loc.append(query_start_loc[-1] + n)
        if needs_token:
            logits_indices.extend(range(query_start_loc[-1] - 1 - len(guesses), query_start_loc[-1]))
    for seq, first, count in batch.prompt_logprob_rows():  # after every sampling row
        at = query_start_loc[batch.seqs.index(seq)] + first - seq.num_computed_tokens
        logits_indices.extend(range(at, at + count))
    group_tables = [[seq.block_table for seq in batch.seqs], [seq.window_block_table for seq in batch.seqs]]
    groups = [_slots_and_tables(tables, batch, block_size) for tables in group_tables[:num_groups]]
    # Built in numpy (a few times faster than torch.tensor for a step's short lists), kept for the executor's
    # copy into a tape's buffers, and shared with the tensors.
    host = [np.array(token_ids, dtype=np.int64), np.array(positions, dtype=np.int64), groups[0][0],
            np.array(context_lens, dtype=np.int32), np.array(query_start_loc, dtype=np.int32),
            np.array(logits_indices, dtype=np.int64)] + [g[0] for g in groups[1:]] + [g[1] for g in groups]
    tensors = [torch.from_numpy(a) for a in host]
    return StepMetadata(
        token_ids=tensors[0], positions=tensors[1], slot_mapping=tensors[2], block_tables=tensors[-num_groups],
        context_lens=tensors[3], query_start_loc=tensors[4], logits_indices=tensors[5],
        **(dict(window_slot_mapping=tensors[6], window_block_tables=tensors[-1]) if num_groups == 2 else {}),
        host_arrays=host, max_position=max(context_lens, default=0) - 1,
    )


def _slots_and_tables(tables: list[list[int]], batch: ScheduledBatch,
                      block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The slot of each packed token ([T] int64) and the block tables ([S, max_blocks] int32, -1 padded)."""
    slots = [table[p // block_size] * block_size + p % block_size
             for seq, n, table in zip(batch.seqs, batch.num_new_tokens, tables)
             for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    width = max(map(len, tables), default=0)
    block_tables = np.array([table + [-1] * (width - len(table)) for table in tables], dtype=np.int32).reshape(
        len(tables), width)
    return np.array(slots, dtype=np.int64), block_tables
