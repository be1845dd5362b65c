"""DeviceSampler: the engine's Sampler when a one-rank cuda executor keeps the logits on the device.

A step whose sequences all decode greedily, with no penalties, logit bias or held-back tokens, takes its tokens on
the device and copies only them to the host (N ids, not N x vocab floats): a constrained sequence's grammar mask
is computed on the host as llguidance's bitmask (4 bytes per 32 tokens), copied over and applied by the mask
kernel to a copy of the logits, the greedy kernel picks each row's token, and the log-probs a request asks for
(its token's and up to 20 alternatives, after its mask as on the host) come from the top-logprobs kernel, R x
(k + 1) numbers. Every other step copies the logits to the host and samples as the cpu Sampler does, so tokens,
seeds and log-probs are the same; so does a step on an engine built before these kernels were compiled into it.
"""

from __future__ import annotations

import torch

from runtime.backends.cuda.kernels import sampling
from runtime.backends.cuda.launch import Launcher, MissingVariant
from runtime.core.constraints import allowed_bits
from runtime.core.sampler import Sampler
from runtime.core.sampling import Logprob
from runtime.core.sequence import Sequence


class DeviceSampler(Sampler):
    def __init__(self, launcher: Launcher):
        self.launcher = launcher

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        if logits.device == self.launcher.device and logits.dim() == 2 and all(map(_device_greedy, seqs)):
            try:
                return self._greedy(logits, seqs)
            except MissingVariant:  # an engine compiled with the greedy kernel alone
                pass
        return super().sample(logits.float().cpu(), seqs)

    def _greedy(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        rows, bits = allowed_bits([seq.constraint for seq in seqs])
        if rows:  # the step's logits stay as they are: a masked copy
            logits = logits.clone()
            sampling.mask_bits(self.launcher, logits, torch.tensor(rows, device=logits.device),
                               torch.from_numpy(bits).to(logits.device))
        tokens = sampling.greedy(self.launcher, logits)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
        if wanted:
            top = max(seqs[i].params.top_logprobs for i in wanted)
            chosen, values, ids = (t.tolist() for t in sampling.top_logprobs(self.launcher, logits, tokens, top))
        token_list = tokens.tolist()
        for seq, token in zip(seqs, token_list):
            if seq.constraint is not None:
                seq.constraint.take(token)
        logprobs: list[float | None] = [None] * len(seqs)
        for i in wanted:
            k = seqs[i].params.top_logprobs
            logprobs[i] = Logprob(chosen[i], zip(ids[i][:k], values[i][:k]))
        return token_list, logprobs

    def verify_batch(self, logits: torch.Tensor, seqs: list[Sequence], proposals) -> tuple[list, list]:
        return super().verify_batch(logits.float().cpu(), seqs, proposals)


def launch_sampler_kernels(launcher: Launcher, logits: torch.Tensor) -> None:
    """Launch every kernel DeviceSampler launches, on logits [R, V] (meta tensors in a build's dry run, real ones in
    `engine-build verify`): greedy, a grammar mask on the first row and top-20 log-probs."""
    device, V = logits.device, logits.shape[1]
    bits = torch.zeros(1, -(-V // 32), dtype=torch.int32, device=device)
    if device.type != "meta":
        bits.fill_(0x55555555)  # every other token allowed
    masked = logits.clone()
    sampling.mask_bits(launcher, masked, torch.zeros(1, dtype=torch.int64, device=device), bits)
    tokens = sampling.greedy(launcher, masked)
    sampling.top_logprobs(launcher, masked, tokens, sampling.TOP_LOGPROBS_MAX)


def _device_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.is_greedy and not p.uses_penalties and not p.logit_bias
            and not p.held_back_token_ids(seq.num_output_tokens))
