"""Which GPU a rank process uses (shared by the GPU backends)."""

from __future__ import annotations

import os

import torch


def rank_device(rank: int) -> torch.device:
    """The GPU of a rank process: LOCAL_RANK where a launcher sets it, else the rank modulo the GPUs."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % max(1, torch.cuda.device_count()))
