"""DeviceSampler: the engine's Sampler when a one-rank cuda executor keeps the logits on the device.

A step whose sequences all decode greedily, with no penalties, held-back tokens or log-probs, takes its tokens
from the greedy kernel and copies only them to the host (N ids, not N x vocab floats). Every other step copies
the logits to the host and samples as the cpu Sampler does, so tokens, seeds and log-probs are the same.
"""

from __future__ import annotations

import torch

from runtime.backends.cuda.kernels import sampling
from runtime.backends.cuda.launch import Launcher
from runtime.core.sampler import Sampler
from runtime.core.sequence import Sequence


class DeviceSampler(Sampler):
    def __init__(self, launcher: Launcher):
        self.launcher = launcher

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        if logits.device == self.launcher.device and logits.dim() == 2 and all(map(_plain_greedy, seqs)):
            return sampling.greedy(self.launcher, logits).tolist(), [None] * len(seqs)
        return super().sample(logits.float().cpu(), seqs)

    def verify_batch(self, logits: torch.Tensor, seqs: list[Sequence], proposals) -> tuple[list, list]:
        return super().verify_batch(logits.float().cpu(), seqs, proposals)


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return p.is_greedy and not p.logprobs and not p.adjusts_logits and not p.held_back_token_ids(seq.num_output_tokens)
