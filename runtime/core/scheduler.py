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
A sequence is admitted with blocks for all its tokens, so only decodes ask for new blocks (the full
layers'; sliding-window layers' blocks come as each step needs them and go once behind the window, from a
pool where admission reserved them: runtime/core/kv_cache.py).

Speculative decoding (with a Speculator): after step 1, each decoding sequence may get k guesses
(runtime/core/speculative.py), which the step carries after its last token as a query chunk of k + 1
tokens with logits at each. Guesses take the token budget left after the decodes (less one
prefill chunk while prompts wait) and only blocks that are free: a guess never preempts. After the
step only the emitted tokens count; blocks that held only rejected guesses are released at once.

Batches in flight (a pipelined engine, pp > 1, runs up to max_batches_in_flight at once): a
sequence is in at most one batch between schedule() and that batch's postprocess(), since its
next token depends on the batch's result; schedule() passes over sequences in flight, and each
batch takes at most its share (1 / max_batches_in_flight) of the unfinished sequences, so the next
batch has sequences of its own. A sequence in flight is never preempted, and abort() defers
finishing it (and freeing its blocks, which its batch still writes) until its batch comes back.

Preemption frees the victim's blocks and puts it at the front of waiting with its outputs kept:
prompt + outputs become its next prefill (often largely a prefix-cache hit on its own freed
blocks), the last output's logits give its next token, and each output position samples from a
random stream of its own (Sequence.noise_key), so it produces the same tokens as if it had never
been preempted. Running stays in arrival order (admission is FIFO and the preempted go back to the
front), so the newest is running[-1].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from runtime.core.kv_cache import BlockManager
from runtime.core.sequence import Sequence, SequenceStatus
from runtime.core.speculative import Proposal, Speculator


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
    # KV groups (runtime/format/kv_groups.py): (0,) every layer full; (W,) every layer windowed, num_blocks theirs;
    # (0, W) full layers with num_blocks and windowed ones with window_blocks of their own
    kv_windows: tuple[int, ...] = (0,)
    window_blocks: int = 0

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
    num_new_tokens: tuple[int, ...]    # guesses included
    needs_token: tuple[bool, ...]
    proposals: tuple[Proposal, ...] = ()  # per sequence when speculating: the guesses after its last token

    def prompt_logprob_rows(self) -> list[tuple[Sequence, int, int]]:
        """(seq, first position, count) of the positions whose logits give prompt log-probs this step: a position
        p of a prefill chunk predicts prompt token p + 1; the positions before the ones already recorded (a
        recompute after preemption) and the last prompt position (it is sampled) give none. Read before
        postprocess(); their logits rows follow the sampling rows, in this order (backends/step.py)."""
        rows = []
        for seq, n in zip(self.seqs, self.num_new_tokens):
            if seq.pending_prompt_logprobs:
                first = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
                end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
                if end > first:
                    rows.append((seq, first, end - first))
        return rows

    def guesses(self, i: int) -> list[int]:
        return self.proposals[i].tokens if self.proposals else []

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order of their logits rows (k + 1 rows for a
        sequence with k guesses, one for every other)."""
        return [seq for seq, needed in zip(self.seqs, self.needs_token) if needed]

    @property
    def sampling_proposals(self) -> list[Proposal]:
        """The proposal of each of sampling_seqs (empty ones when not speculating)."""
        if not self.proposals:
            return [Proposal([])] * sum(self.needs_token)
        return [p for p, needed in zip(self.proposals, self.needs_token) if needed]

    @property
    def decodes_only(self) -> bool:
        """Every sequence computes one token of its own (and its guesses): no prefill in the step."""
        return all(n - len(self.guesses(i)) == 1 for i, n in enumerate(self.num_new_tokens))

    @property
    def is_speculative(self) -> bool:
        return any(p.tokens for p in self.proposals)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the waiting and running queues and the BlockManager; one schedule()/postprocess() per batch."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = (),
                 speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator
        self.eos_token_ids = frozenset(eos_token_ids)
        pools = (config.num_blocks, config.window_blocks)[:len(config.kv_windows)]
        self.block_manager = BlockManager(pools, config.block_size, config.enable_prefix_caching, config.kv_windows,
                                          config.max_num_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by request id
        self.in_flight: set[Sequence] = set()    # in a batch scheduled and not yet postprocessed
        self.aborted_in_flight: set[Sequence] = set()  # finished when their batch is back
        self.num_preemptions = 0
        self.before_free: Callable[[Sequence], None] | None = None  # for hand_off sequences that finish

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError, before taking any blocks, if it could never run."""
        self._check_new(seq)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, first_token: int, first_logprob: float | None, write_kv) -> bool:
        """A request another engine prefilled (runtime/core/disaggregation.py): with blocks free now it runs at
        once, its prompt's K/V written by write_kv(seq, start) from position `start` on (the positions its
        cached prefix does not cover) and its first token appended, to decode next step; True. Otherwise it
        waits with its first token, and is recomputed when admitted, as a preempted sequence is; False.
        ValueError, before taking any blocks, if it could never run or has nothing left to decode."""
        self._check_new(seq)
        if seq.params.max_tokens < 2 or self._finish_reason(seq, first_token) is not None:
            raise ValueError(f"request {seq.request_id!r}: its first token ends it; nothing is left to decode")
        seq.append_token(first_token, first_logprob)
        self.requests[seq.request_id] = seq
        bm = self.block_manager
        if len(self.running) >= self.config.max_batch_size or not bm.can_allocate(seq):
            self.waiting.append(seq)
            return False
        bm.allocate(seq)
        start, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_prompt_tokens
        bm.append_slots(seq, seq.num_prompt_tokens)  # a windowed group: the blocks its next query sees
        write_kv(seq, start)
        bm.cache_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _check_new(self, seq: Sequence) -> None:
        cfg, rid = self.config, seq.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids:
            raise ValueError(f"request {rid!r}: add() takes a new sequence, got {seq!r}")
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if total > cfg.max_seq_len:
            raise ValueError(f"request {rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.params.max_tokens}) = {total} exceeds max_seq_len ({cfg.max_seq_len})")
        problem = self.block_manager.problem(seq, total)
        if problem:
            raise ValueError(f"request {rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.params.max_tokens}) {problem}")

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
        proposals: list[Proposal] = []
        if self.speculator is not None and seqs:
            proposals, counts = self._speculate(seqs, budget)
            budget -= sum(counts) - len(seqs)
            budget = max(budget, 0)
        if seqs and cfg.prefill_chunk is not None:
            budget = min(budget, cfg.prefill_chunk)
        for seq in self.running:
            if budget == 0 or len(seqs) == max_seqs:
                break
            if seq.num_pending_tokens > 1 and seq not in self.in_flight:
                seqs.append(seq)
                counts.append(min(seq.num_pending_tokens, budget))
                bm.append_slots(seq, seq.num_computed_tokens + counts[-1])  # a windowed group's blocks
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
            bm.append_slots(seq, seq.num_computed_tokens + counts[-1])
            budget -= counts[-1]
        if proposals:
            proposals += [Proposal([])] * (len(seqs) - len(proposals))
        guessed = [len(p.tokens) for p in proposals] or [0] * len(seqs)
        needs_token = tuple(s.num_computed_tokens + n - g == s.num_tokens for s, n, g in zip(seqs, counts, guessed))
        self.in_flight.update(seqs)
        return ScheduledBatch(tuple(seqs), tuple(counts), needs_token, tuple(proposals))

    def _speculate(self, decoding: list[Sequence], budget: int) -> tuple[list[Proposal], list[int]]:
        """Guesses for the decoding sequences within `budget` tokens (one prefill chunk kept for waiting
        prompts) and the free blocks; each sequence's token count, 1 + its guesses."""
        cfg, bm = self.config, self.block_manager
        prefill = 0
        admissible = self.waiting and len(self.running) < cfg.max_batch_size
        if admissible or any(s.num_pending_tokens > 1 and s not in self.in_flight for s in self.running):
            prefill = min(budget, cfg.prefill_chunk or budget)
        proposals = self.speculator.propose(decoding, budget - prefill, len(decoding) + prefill)
        counts = []
        for i, (seq, proposal) in enumerate(zip(decoding, proposals)):
            guesses = proposal.tokens
            # Slots for positions num_tokens .. num_tokens + k - 1, from blocks nobody holds.
            fits = len(seq.block_table) * bm.block_size + bm.num_free_blocks * bm.block_size - seq.num_tokens
            if len(guesses) > fits:
                guesses = guesses[:max(fits, 0)]
                proposals[i] = Proposal(guesses)
            bm.append_slots(seq, seq.num_tokens + len(guesses))
            counts.append(1 + len(guesses))
        return proposals, counts

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int | list[int]],
                    logprobs: list | None = None) -> list[Sequence]:
        """Record a step's results: advance computed tokens, append sampled tokens, finish on EOS/length.

        token_ids (and logprobs) follow batch.sampling_seqs: one token each, or for a sequence with
        guesses the list of tokens the step emitted (accepted guesses, then the target's own token).
        Sequences aborted or finished since schedule() are skipped (one aborted in flight is finished
        now). Returns the sequences that finished here.
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
        emitted = {}
        for seq, tokens, lps in zip(sampling_seqs, token_ids, logprobs):
            if not isinstance(tokens, list):
                tokens, lps = [tokens], [lps]
            emitted[seq] = (tokens, lps if lps is not None else [None] * len(tokens))
        finished = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            guesses = batch.guesses(i)
            if seq not in emitted:  # a prefill chunk before the last
                seq.num_computed_tokens += n
                self.block_manager.cache_blocks(seq)
                continue
            reason = None
            tokens, lps = emitted[seq]
            appended = 0
            for token_id, logprob in zip(tokens, lps):
                seq.append_token(int(token_id), logprob)
                appended += 1
                reason = self._finish_reason(seq, int(token_id))
                if reason is not None:
                    break
            # Valid K/V now: the step's tokens up to the last accepted guess (n - len(guesses) without any).
            seq.num_computed_tokens += n - len(guesses) + appended - 1
            self.block_manager.cache_blocks(seq)
            if guesses:
                self.block_manager.trim(seq)
                self.speculator.record(seq, len(guesses), appended)
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
        if self.speculator is not None:
            self.speculator.release(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if seq.hand_off and reason != "abort" and self.before_free is not None:
                self.before_free(seq)  # its K/V, read out before the blocks can be reused
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
