"""Scheduler: in-flight batching of decode tokens and prefill chunks over waiting/running queues.

Each schedule() builds one step within max_num_tokens:
1. every running sequence that decodes gets its one token (all fit: running never exceeds
   max_batch_size, and max_num_tokens >= max_batch_size). One that needs a new block and finds
   none preempts the newest running sequence not in flight (possibly itself) until it fits.
2. running sequences part-way through their prefill continue, oldest first, in chunks that fill
   the remaining budget; while any sequence decodes in the step, prefill takes at most
   prefill_chunk tokens of it (a step's time grows with its tokens, and every decoding request
   waits for the whole step: on 2 cores a step with 512 prefill tokens takes about 1 s, ten
   times a decode step of 32 sequences);
3. waiting sequences are admitted in arrival order (strictly FIFO, so none starves) while the
   budget, max_batch_size and the free blocks allow, each reusing its cached prefix and starting
   its first chunk.
A sequence is admitted with blocks for all its tokens, so only decodes ask for new blocks.

Batches in flight (a pipelined engine, pp > 1, runs up to max_batches_in_flight at once): a
sequence is in at most one batch between schedule() and that batch's postprocess(), since its
next token depends on the batch's result; schedule() passes over sequences in flight, and each
batch takes at most its share (1 / max_batches_in_flight) of the unfinished sequences, so the next
batch has sequences of its own. A sequence in flight is never preempted, and abort() defers
finishing it (and freeing its blocks, which its batch still writes) until its batch comes back.

Preemption frees the victim's blocks and puts it at the front of waiting with its outputs kept:
prompt + outputs become its next prefill (often largely a prefix-cache hit on its own freed
blocks), the last output's logits give its next token, and its generator is not reset, so it
produces the same tokens as if it had never been preempted. Running stays in arrival order
(admission is FIFO and the preempted go back to the front), so the newest is running[-1].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from runtime.kv_cache import BlockManager
from runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int    # sequences running at once
    max_num_tokens: int    # tokens per step (decode tokens + prefill chunks)
    max_seq_len: int       # prompt + max_tokens of one request
    num_blocks: int        # KV cache blocks in the pool
    block_size: int        # tokens per block
    enable_prefix_caching: bool = True
    max_batches_in_flight: int = 1  # batches scheduled and not yet postprocessed at once (a pipeline's depth)
    prefill_chunk: int | None = None  # prefill tokens in a step that also decodes (None: the whole budget)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "num_blocks", "block_size",
                     "max_batches_in_flight") + (("prefill_chunk",) if self.prefill_chunk is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                             f"({self.max_batch_size}) so every running sequence can decode each step; "
                             f"raise max_num_tokens or lower max_batch_size")


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: seqs[i] computes its next num_new_tokens[i] tokens; needs_token[i] if it is then sampled.

    A sequence is sampled when this step computes its last token (a decode, or the last prefill chunk).
    """

    seqs: tuple[Sequence, ...]
    num_new_tokens: tuple[int, ...]
    needs_token: tuple[bool, ...]

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order of the logits rows."""
        return [seq for seq, needed in zip(self.seqs, self.needs_token) if needed]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the waiting and running queues and the BlockManager; one schedule()/postprocess() per batch."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = ()):
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by request id
        self.in_flight: set[Sequence] = set()    # in a batch scheduled and not yet postprocessed
        self.aborted_in_flight: set[Sequence] = set()  # finished when their batch is back
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError, before taking any blocks, if it could never run."""
        cfg, rid = self.config, seq.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids:
            raise ValueError(f"request {rid!r}: add() takes a new sequence, got {seq!r}")
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if total > cfg.max_seq_len:
            raise ValueError(f"request {rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.params.max_tokens}) = {total} exceeds max_seq_len ({cfg.max_seq_len})")
        # The last output token is never written to the cache, so the longest KV is total - 1 tokens.
        blocks = self.block_manager.blocks_needed(total - 1)
        if blocks > cfg.num_blocks:
            raise ValueError(f"request {rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.params.max_tokens}) needs {blocks} KV blocks of {cfg.block_size} tokens, "
                             f"but the cache has only {cfg.num_blocks}")
        self.requests[rid] = seq
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts (see the module docstring for the policy)."""
        cfg, bm = self.config, self.block_manager
        max_seqs = -(-(len(self.running) + len(self.waiting)) // cfg.max_batches_in_flight)  # this batch's share
        seqs: list[Sequence] = []
        counts: list[int] = []
        for seq in list(self.running):
            if len(seqs) == max_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING or seq in self.in_flight or seq.num_pending_tokens != 1:
                continue
            while not bm.can_append(seq):
                victim = next(s for s in reversed(self.running) if s not in self.in_flight)  # seq at the latest
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.append_slot(seq)
                seqs.append(seq)
                counts.append(1)
        budget = cfg.max_num_tokens - len(seqs)
        if seqs and cfg.prefill_chunk is not None:
            budget = min(budget, cfg.prefill_chunk)
        for seq in self.running:
            if budget == 0 or len(seqs) == max_seqs:
                break
            if seq.num_pending_tokens > 1 and seq not in self.in_flight:
                seqs.append(seq)
                counts.append(min(seq.num_pending_tokens, budget))
                budget -= counts[-1]
        while self.waiting and budget > 0 and len(seqs) < max_seqs and len(self.running) < cfg.max_batch_size:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(min(seq.num_pending_tokens, budget))
            budget -= counts[-1]
        needs_token = tuple(s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts))
        self.in_flight.update(seqs)
        return ScheduledBatch(tuple(seqs), tuple(counts), needs_token)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int],
                    logprobs: list[float | None] | None = None) -> list[Sequence]:
        """Record a step's results: advance computed tokens, append sampled tokens, finish on EOS/length.

        token_ids (and logprobs) follow batch.sampling_seqs. Sequences aborted or finished since
        schedule() are skipped (one aborted in flight is finished now). Returns the sequences that
        finished here.
        """
        sampling_seqs = batch.sampling_seqs
        if len(token_ids) != len(sampling_seqs):
            raise ValueError(f"postprocess: {len(token_ids)} tokens for {len(sampling_seqs)} sampled sequences")
        if logprobs is None:
            logprobs = [None] * len(token_ids)
        for seq in batch.seqs:
            self.in_flight.discard(seq)
            if seq in self.aborted_in_flight:
                self.finish(seq, "abort")
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
                self.block_manager.cache_blocks(seq)
        finished = []
        for seq, token_id, logprob in zip(sampling_seqs, token_ids, logprobs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.append_token(int(token_id), logprob)
            reason = self._finish_reason(seq, int(token_id))
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now ("stop" | "length" | "abort"): leave the queues, free its blocks at once.

        Call it for a sequence in flight only once its batch is over (came back, or failed).
        """
        self.in_flight.discard(seq)
        self.aborted_in_flight.discard(seq)
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with reason "abort"; returns it, or None if it is unknown or already finished.

        A sequence in flight is finished (its blocks freed) when its batch comes back: the batch
        still writes its K/V. Until then its request id stays in use.
        """
        seq = self.requests.get(request_id)
        if seq in self.in_flight:
            self.aborted_in_flight.add(seq)
        elif seq is not None:
            self.finish(seq, "abort")
        return seq

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it first, to be recomputed from its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
