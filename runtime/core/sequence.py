"""Sequence: one request's tokens, KV blocks, progress and random state as the scheduler moves it."""

from __future__ import annotations

import enum
import itertools

import torch

from runtime.core.sampling import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued, holds no blocks (new, or preempted and waiting to be recomputed)
    RUNNING = "running"    # holds blocks; prefilling in chunks or decoding one token per step
    FINISHED = "finished"  # done; finish_reason says why; blocks already freed


class Sequence:
    """A request as the scheduler sees it.

    token_ids = prompt_token_ids + output_token_ids. Tokens 0 .. num_computed_tokens-1 have their
    K/V in the cache (of which the first num_cached_tokens came from the prefix cache); the rest are
    computed by coming steps. After a prefill completes, the newest sampled token is always the one
    uncomputed token, written to the cache by the next decode step.

    seed is params.seed, or, when that is None, drawn from torch's global generator (so
    torch.manual_seed makes unseeded runs reproducible). Each output position has a random stream of
    its own, noise_key(index), a function of the seed and the position only: the token sampled at
    a position does not depend on how many draws came before it, so a preempted and recomputed
    sequence, or one whose positions a speculative step verifies several at a time, samples exactly
    the tokens it would have sampled one step at a time.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None):
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty (a prompt needs at least one token)")
        self.request_id = request_id
        self.params = params if params is not None else SamplingParams()
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(prompt)  # prompt + output, kept as one list for cheap slicing
        self.logprobs: list[float] = []  # log-prob of each output token, when params.logprobs
        # log-prob of each prompt token when params.prompt_logprobs is set (None for the first: nothing before it)
        self.prompt_logprobs: list[float | None] = [None]
        self.constraint = None  # params.grammar's state (runtime/core/constraints.py Constraint), set by the engine
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.arrival = next(_arrival_counter)
        self.block_table: list[int] = []
        self.window_block_table: list[int] = []  # the windowed layers' blocks beside the full layers' (-1: given back)
        self.block_hashes: list[bytes] = []  # chained hashes of leading full computed blocks (BlockManager's)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.adaptive_k = None        # speculative decoding's AdaptiveK for this sequence, once it speculates
        self.num_proposed_tokens = 0  # guesses verified for this sequence
        self.num_accepted_tokens = 0  # of those, the ones that stood
        self.hand_off = False         # disaggregated prefill: read the prompt's K/V out when it finishes
        self.kv_handoff = None        # ... into this (runtime/core/disaggregation.py KVHandoff)
        seed = self.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed

    def noise_key(self, output_index: int) -> int:
        """The key of the random stream that samples output token `output_index` (0 is the first output
        token): runtime/core/sampler.py's race noise is a function of it and the token id."""
        return _mix(self.seed, output_index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def pending_prompt_logprobs(self) -> bool:
        """Its prompt's log-probs are asked for and not all computed yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V is not yet in the cache: the rest of the prefill, or 1 when decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Forget all cached state (after preemption): prompt + outputs so far become the next prefill."""
        self.status = SequenceStatus.WAITING
        self.block_table = []
        self.window_block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


_MASK64 = (1 << 64) - 1


def _mix(seed: int, index: int) -> int:
    """A 63-bit seed for (seed, index): splitmix64's finaliser over the pair, so neighbouring positions
    and neighbouring request seeds get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
