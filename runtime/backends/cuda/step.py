"""The inputs of a step on the device, shared by the executor and the decode graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.backends.step import StepMetadata


@dataclass
class DeviceStep:
    """A step's inputs on the device, in the types the kernels take."""

    token_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int32
    slot_mapping: torch.Tensor     # [T] int32, -1: write nothing (a padded row)
    block_tables: torch.Tensor     # [S, W] int32
    context_lens: torch.Tensor     # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    logits_indices: torch.Tensor   # [N] int64
    max_query_len: int             # host-side: the attention grid's second dimension

    @staticmethod
    def of(meta: StepMetadata, device: torch.device) -> DeviceStep:
        qsl = meta.query_start_loc
        longest = int((qsl[1:] - qsl[:-1]).max()) if qsl.numel() > 1 else 0
        to = lambda t, dtype: t.to(device=device, dtype=dtype, non_blocking=True)  # noqa: E731
        return DeviceStep(to(meta.token_ids, torch.int64), to(meta.positions, torch.int32),
                          to(meta.slot_mapping, torch.int32), to(meta.block_tables, torch.int32),
                          to(meta.context_lens, torch.int32), to(qsl, torch.int32),
                          to(meta.logits_indices, torch.int64), longest)
