"""StepMetadata: the packed tokens of one step and where their K/V lives, built from a ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.scheduler import ScheduledBatch


@dataclass
class StepMetadata:
    token_ids: torch.Tensor        # [T] int64, packed tokens of all sequences in the step
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, KV cache slot of each token
    block_tables: torch.Tensor     # [S, max_blocks] int32, -1 padded
    context_lens: torch.Tensor     # [S] int32, tokens in cache for each seq after this step's write
    query_start_loc: torch.Tensor  # [S+1] int32, offsets of each seq's tokens in T
    logits_indices: torch.Tensor   # [N] int64, indices into T whose logits are needed


def build_step_metadata(batch: ScheduledBatch, block_size: int) -> StepMetadata:
    """Pack batch.seqs in order: seq s computes tokens num_computed_tokens .. +num_new_tokens[s].

    Call after schedule() and before postprocess() (it reads each sequence's num_computed_tokens).
    logits_indices holds the last packed token of each sequence in batch.sampling_seqs, in order; a
    sequence with speculative guesses computes its last token and then the guesses, and has logits
    at all of them (k + 1 rows).
    """
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    for i, (seq, n, needs_token) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.needs_token)):
        start, table, guesses = seq.num_computed_tokens, seq.block_table, batch.guesses(i)
        token_ids.extend(seq.token_ids[start:start + n - len(guesses)])
        token_ids.extend(guesses)
        span = range(start, start + n)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        context_lens.append(start + n)
        query_start_loc.append(query_start_loc[-1] + n)
        if needs_token:
            logits_indices.extend(range(query_start_loc[-1] - 1 - len(guesses), query_start_loc[-1]))
    max_blocks = max((len(seq.block_table) for seq in batch.seqs), default=0)
    block_tables = torch.full((len(batch.seqs), max_blocks), -1, dtype=torch.int32)  # [S, max_blocks]
    for row, seq in zip(block_tables, batch.seqs):
        row[:len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    return StepMetadata(
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )
