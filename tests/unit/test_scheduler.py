"""Scheduler + BlockManager + step metadata, driven by a fake model that reads its context back from the cache."""

from collections import deque

import numpy as np
import pytest
import torch

from runtime.core.sampler import Sampler
from runtime.core.sampling import SamplingParams
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import Sequence, SequenceStatus
from runtime.backends.step import build_step_metadata

VOCAB = 50


def next_token(context: list[int]) -> int:
    """The fake model's deterministic 'forward pass': depends on every token and its position."""
    return (sum((k + 1) * t for k, t in enumerate(context)) + 7) % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeModel:
    """Stands in for the executor. Its 'K/V' of a token is (token id, position), written through
    slot_mapping; a logits row is computed from the context read back through block_tables, so a
    wrong slot, block table, context length or reused block changes the generated tokens."""

    def __init__(self, num_blocks: int, block_size: int, spread: bool = False):
        self.block_size = block_size
        self.spread = spread  # logits spread over the vocabulary (for random sampling), else one-hot
        self.cache: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def execute(self, meta) -> torch.Tensor:
        tokens, positions = meta.token_ids.tolist(), meta.positions.tolist()
        for t, slot in enumerate(meta.slot_mapping.tolist()):
            self.cache[slot] = (tokens[t], positions[t])
        qsl, ctx_lens, tables = meta.query_start_loc.tolist(), meta.context_lens.tolist(), meta.block_tables.tolist()
        logits = torch.zeros(len(meta.logits_indices), VOCAB)
        for row, index in enumerate(meta.logits_indices.tolist()):
            s = max(s for s in range(len(ctx_lens)) if qsl[s] <= index)
            num_context = ctx_lens[s] - (qsl[s + 1] - qsl[s]) + (index - qsl[s]) + 1
            context = []
            for p in range(num_context):
                block = tables[s][p // self.block_size]
                assert block >= 0
                token, position = self.cache[block * self.block_size + p % self.block_size]
                assert position == p
                context.append(token)
            if self.spread:
                logits[row] = torch.sin(torch.arange(VOCAB) * (next_token(context) + 1) * 0.37) * 3
            else:
                logits[row, next_token(context)] = 1.0
        return logits


def make_scheduler(max_batch_size=4, max_num_tokens=8, max_seq_len=64, num_blocks=16, block_size=4, eos=(),
                   spread=False, max_batches_in_flight=1, prefill_chunk=None):
    config = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                             num_blocks=num_blocks, block_size=block_size, max_batches_in_flight=max_batches_in_flight,
                             prefill_chunk=prefill_chunk)
    return Scheduler(config, eos_token_ids=eos), FakeModel(num_blocks, block_size, spread)


def greedy(max_tokens=4, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def step(scheduler, model, sampler=Sampler()):
    """One LLMEngine.step(); returns the batch as [(request_id, num_new_tokens, needs_token)] and the metadata."""
    batch = scheduler.schedule()
    meta = build_step_metadata(batch, scheduler.config.block_size)
    logits = model.execute(meta)
    tokens, logprobs = sampler.sample(logits, batch.sampling_seqs)
    scheduler.postprocess(batch, tokens, logprobs)
    return [(s.request_id, n, t) for s, n, t in zip(batch.seqs, batch.num_new_tokens, batch.needs_token)], meta


def run_all(scheduler, model, max_steps=500):
    trace = []
    while scheduler.has_unfinished:
        entries, _ = step(scheduler, model)
        assert entries, "a step with unfinished requests scheduled nothing"
        trace.append(entries)
        assert len(trace) < max_steps
    return trace


def run_pipelined(scheduler, model, max_steps=500):
    """LLMEngine.step with batches in flight: schedule until the most are in flight, then postprocess the
    oldest. The model runs a batch when it is scheduled, as a pipeline's stages do, in that order.
    Returns the request ids of the batches in flight at each step."""
    in_flight, trace = deque(), []
    while scheduler.has_unfinished:
        while len(in_flight) < scheduler.config.max_batches_in_flight:
            batch = scheduler.schedule()
            if batch.is_empty:
                break
            assert not {s.request_id for s in batch.seqs} & {s.request_id for b, _ in in_flight for s in b.seqs}
            in_flight.append((batch, model.execute(build_step_metadata(batch, scheduler.config.block_size))))
        assert in_flight, "nothing in flight and nothing scheduled with unfinished requests"
        trace.append([[s.request_id for s in batch.seqs] for batch, _ in in_flight])
        batch, logits = in_flight.popleft()
        tokens, logprobs = Sampler().sample(logits, batch.sampling_seqs)
        scheduler.postprocess(batch, tokens, logprobs)
        assert len(trace) < max_steps
    return trace


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    scheduler, model = make_scheduler(max_num_tokens=8)
    a = Sequence("a", range(1, 21), greedy(max_tokens=2))
    scheduler.add(a)
    entries, meta = step(scheduler, model)
    assert entries == [("a", 8, False)]
    assert meta.positions.tolist() == list(range(8)) and meta.slot_mapping.tolist() == list(range(8))
    assert meta.logits_indices.tolist() == [] and a.output_token_ids == []
    assert step(scheduler, model)[0] == [("a", 8, False)]
    entries, meta = step(scheduler, model)
    assert entries == [("a", 4, True)]
    assert meta.positions.tolist() == list(range(16, 20)) and meta.logits_indices.tolist() == [3]
    assert meta.context_lens.tolist() == [20] and meta.query_start_loc.tolist() == [0, 4]
    assert step(scheduler, model)[0] == [("a", 1, True)]
    assert a.is_finished and a.finish_reason == "length"
    assert a.output_token_ids == reference_output(list(range(1, 21)), 2)


def test_prefill_chunk_limits_prefill_only_in_steps_that_decode():
    scheduler, model = make_scheduler(max_num_tokens=12, num_blocks=32, prefill_chunk=3)
    a_prompt, b_prompt = [5, 6, 7], list(range(10, 20))
    scheduler.add(Sequence("a", a_prompt, greedy(max_tokens=6)))
    assert step(scheduler, model)[0] == [("a", 3, True)]  # nothing decodes yet: the whole budget
    scheduler.add(Sequence("b", b_prompt, greedy(max_tokens=2)))
    assert step(scheduler, model)[0] == [("a", 1, True), ("b", 3, False)]  # a decodes: b prefills 3 at a time
    assert step(scheduler, model)[0] == [("a", 1, True), ("b", 3, False)]
    assert step(scheduler, model)[0] == [("a", 1, True), ("b", 3, False)]
    assert step(scheduler, model)[0] == [("a", 1, True), ("b", 1, True)]
    run_all(scheduler, model)
    assert scheduler.requests == {}


def test_prefill_chunk_must_be_positive():
    with pytest.raises(ValueError, match="prefill_chunk"):
        SchedulerConfig(max_batch_size=4, max_num_tokens=8, max_seq_len=64, num_blocks=16, block_size=4,
                        prefill_chunk=0)


def test_decodes_first_then_partial_prefills_then_new_prompts():
    scheduler, model = make_scheduler(max_num_tokens=8, block_size=4)
    a_prompt, b_prompt, c_prompt = list(range(1, 21)), [30, 31, 32, 33, 34], [40, 41, 42]
    scheduler.add(Sequence("a", a_prompt, greedy(max_tokens=3)))
    scheduler.add(Sequence("b", b_prompt, greedy(max_tokens=3)))
    assert step(scheduler, model)[0] == [("a", 8, False)]
    assert step(scheduler, model)[0] == [("a", 8, False)]
    entries, meta = step(scheduler, model)  # a's last chunk, then b starts with what is left
    assert entries == [("a", 4, True), ("b", 4, False)]
    assert meta.token_ids.tolist() == a_prompt[16:] + b_prompt[:4]
    assert meta.positions.tolist() == [16, 17, 18, 19, 0, 1, 2, 3]
    assert meta.slot_mapping.tolist() == [16, 17, 18, 19, 20, 21, 22, 23]
    assert meta.block_tables.tolist() == [[0, 1, 2, 3, 4], [5, 6, -1, -1, -1]]
    assert meta.context_lens.tolist() == [20, 4] and meta.query_start_loc.tolist() == [0, 4, 8]
    assert meta.logits_indices.tolist() == [3]
    scheduler.add(Sequence("c", c_prompt, greedy(max_tokens=1)))
    entries, meta = step(scheduler, model)  # a decodes, b's one-token remainder, c joins
    assert entries == [("a", 1, True), ("b", 1, True), ("c", 3, True)]
    assert meta.logits_indices.tolist() == [0, 1, 4]
    assert scheduler.requests.keys() == {"a", "b"}  # c left after its one token
    run_all(scheduler, model)
    assert scheduler.block_manager.usage == 0.0


def test_max_batch_size_caps_running_and_sequences_join_as_others_leave():
    scheduler, model = make_scheduler(max_batch_size=2, max_num_tokens=16)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 2)):
        scheduler.add(Sequence(rid, [1, 2, 3], greedy(max_tokens=max_tokens)))
    trace = run_all(scheduler, model)
    assert trace == [
        [("a", 3, True), ("b", 3, True)],  # a finishes at once (max_tokens=1)
        [("b", 1, True), ("c", 3, True)],  # c joins as a leaves
        [("b", 1, True), ("c", 1, True)],  # b and c both finish
    ]


def test_preemption_picks_the_newest_and_recomputation_restores_its_state():
    scheduler, model = make_scheduler(max_num_tokens=8, num_blocks=4, block_size=2, max_seq_len=16)
    a = Sequence("a", [1, 2, 3], greedy(max_tokens=4))
    b = Sequence("b", [4, 5, 6], greedy(max_tokens=4))
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler, model)[0] == [("a", 3, True), ("b", 3, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert step(scheduler, model)[0] == [("a", 1, True), ("b", 1, True)]
    # a's 5th token needs a third block and none is free: b, the newest, is preempted.
    b_outputs = list(b.output_token_ids)
    assert step(scheduler, model)[0] == [("a", 1, True)]
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == b_outputs and b.token_ids == [4, 5, 6] + b_outputs
    assert a.block_table == [0, 1, 3]  # b's blocks were freed tail first; a took b's last block
    assert step(scheduler, model)[0] == [("a", 1, True)]  # a finishes; b does not fit until then
    assert a.finish_reason == "length"
    # b comes back: its first block (2) is still cached, the rest is recomputed as a prefill.
    assert step(scheduler, model)[0] == [("b", 3, True)]
    assert b.num_cached_tokens == 2 and b.block_table[0] == 2
    run_all(scheduler, model)
    assert a.output_token_ids == reference_output([1, 2, 3], 4)
    assert b.output_token_ids == reference_output([4, 5, 6], 4)


def test_many_requests_under_memory_pressure_match_the_reference():
    # Shared prefixes, chunked prefill and repeated preemption all at once: outputs stay exact.
    scheduler, model = make_scheduler(max_batch_size=6, max_num_tokens=10, num_blocks=12, block_size=2,
                                      max_seq_len=40)
    prompts = {f"r{i}": [3, 1, 4, 1, 5, 9][: 2 + i % 5] + list(range(i, i + 3 + i % 4)) for i in range(12)}
    for rid, prompt in prompts.items():
        scheduler.add(Sequence(rid, prompt, greedy(max_tokens=6 + int(rid[1:]) % 5)))
    seqs = dict(scheduler.requests)
    run_all(scheduler, model)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.prefix_cache_hits > 0
    for rid, seq in seqs.items():
        assert seq.output_token_ids == reference_output(prompts[rid], seq.params.max_tokens), rid
    assert scheduler.block_manager.num_free_blocks == 12


def test_seeded_sampling_under_preemption_matches_a_run_without_it():
    def outputs(num_blocks):
        scheduler, model = make_scheduler(max_num_tokens=12, num_blocks=num_blocks, block_size=2, max_seq_len=24,
                                          spread=True)
        seqs = [Sequence(f"r{i}", [i + 1, i + 2, i + 3], SamplingParams(temperature=1.0, seed=i, max_tokens=9))
                for i in range(4)]
        for seq in seqs:
            scheduler.add(seq)
        run_all(scheduler, model)
        return [seq.output_token_ids for seq in seqs], scheduler.num_preemptions

    roomy, roomy_preemptions = outputs(num_blocks=32)
    tight, tight_preemptions = outputs(num_blocks=8)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_prefix_reuse_waits_for_blocks_to_be_computed():
    # b arrives while a is part-way through a chunked prefill of the same prompt: it may reuse
    # only the blocks a has already computed, never ones a pending chunk has yet to write.
    scheduler, model = make_scheduler(max_num_tokens=12, block_size=4, num_blocks=16)
    prompt = list(range(1, 21))
    scheduler.add(Sequence("a", prompt, greedy(max_tokens=2)))
    assert step(scheduler, model)[0] == [("a", 12, False)]
    b = Sequence("b", prompt, greedy(max_tokens=2))
    scheduler.add(b)
    assert step(scheduler, model)[0] == [("a", 8, True), ("b", 4, False)]
    assert b.num_cached_tokens == 12 and scheduler.block_manager.prefix_cache_hits == 12
    run_all(scheduler, model)
    assert b.output_token_ids == reference_output(prompt, 2)


def test_second_request_reuses_the_first_requests_prefix():
    scheduler, model = make_scheduler(max_num_tokens=16, block_size=4)
    prompt = list(range(1, 11))
    scheduler.add(Sequence("a", prompt, greedy(max_tokens=3)))
    run_all(scheduler, model)
    scheduler.add(Sequence("b", prompt[:8] + [77, 78], greedy(max_tokens=3)))
    entries, meta = step(scheduler, model)
    assert entries == [("b", 2, True)]  # 8 cached tokens skipped
    assert meta.positions.tolist() == [8, 9] and meta.block_tables.tolist()[0][:2] == [0, 1]
    assert scheduler.block_manager.prefix_cache_hits == 8
    run_all(scheduler, model)
    assert scheduler.requests == {}


def test_impossible_requests_are_rejected_before_taking_blocks():
    scheduler, _ = make_scheduler(max_seq_len=32, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_tokens \(4\) = 34 exceeds max_seq_len \(32\)"):
        scheduler.add(Sequence("long", range(30), greedy(max_tokens=4)))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 4 tokens, but the cache has only 4"):
        scheduler.add(Sequence("big", range(14), greedy(max_tokens=4)))
    scheduler.add(Sequence("fits", range(13), greedy(max_tokens=4)))  # 16 tokens of KV: exactly 4 blocks
    assert list(scheduler.requests) == ["fits"]
    assert scheduler.block_manager.num_free_blocks == 4
    with pytest.raises(ValueError, match="request_id 'fits' is already in use"):
        scheduler.add(Sequence("fits", [1], greedy()))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Sequence("empty", [], greedy())


def test_abort_frees_blocks_at_once():
    scheduler, model = make_scheduler(max_num_tokens=8, num_blocks=8, block_size=4)
    scheduler.add(Sequence("a", range(1, 11), greedy(max_tokens=8)))
    scheduler.add(Sequence("b", range(20, 23), greedy(max_tokens=8)))
    scheduler.add(Sequence("c", range(30, 33), greedy(max_tokens=8)))
    step(scheduler, model)  # a takes the whole budget; b and c wait
    assert scheduler.block_manager.num_free_blocks == 5
    a = scheduler.abort("a")
    assert a.finish_reason == "abort" and a.is_finished and a.block_table == []
    assert scheduler.block_manager.num_free_blocks == 8 and list(scheduler.running) == []
    b = scheduler.abort("b")  # waiting: leaves the queue
    assert b.finish_reason == "abort" and [s.request_id for s in scheduler.waiting] == ["c"]
    assert scheduler.abort("b") is None and scheduler.abort("nope") is None

    # Aborted between schedule() and postprocess(): the step's result for it is dropped.
    batch = scheduler.schedule()
    meta = build_step_metadata(batch, 4)
    scheduler.abort("c")
    scheduler.postprocess(batch, [7] * len(batch.sampling_seqs))
    assert batch.seqs[0].output_token_ids == [] and not scheduler.has_unfinished
    assert scheduler.block_manager.num_free_blocks == 8 and meta.token_ids.tolist() == [30, 31, 32]


def test_finish_on_eos_stop_token_ids_length_and_engine_stop():
    scheduler, model = make_scheduler(eos=[next_token([1, 2])])
    eos_hit = Sequence("eos", [1, 2], greedy(max_tokens=5))
    ignored = Sequence("ignored", [1, 2], greedy(max_tokens=2, ignore_eos=True))
    stop_id = Sequence("stop_id", [3, 4], greedy(max_tokens=5, stop_token_ids=[next_token([3, 4])]))
    engine_stopped = Sequence("engine", [5, 6], greedy(max_tokens=5))
    for seq in (eos_hit, ignored, stop_id, engine_stopped):
        scheduler.add(seq)
    step(scheduler, model)
    assert (eos_hit.finish_reason, stop_id.finish_reason) == ("stop", "stop")
    assert eos_hit.output_token_ids == [next_token([1, 2])] and not ignored.is_finished
    scheduler.finish(engine_stopped, "stop")  # a stop string matched, as the engine decides
    assert engine_stopped.finish_reason == "stop" and engine_stopped.block_table == []
    run_all(scheduler, model)
    assert ignored.finish_reason == "length" and ignored.num_output_tokens == 2


def test_logprobs_are_recorded_when_requested():
    scheduler, model = make_scheduler()
    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True))
    scheduler.add(seq)
    run_all(scheduler, model)
    expected = torch.log_softmax(torch.tensor([1.0] + [0.0] * (VOCAB - 1)), dim=0)[0].item()
    assert seq.logprobs == pytest.approx([expected] * 3)


@pytest.mark.parametrize("field, value", [("max_batch_size", 0), ("max_num_tokens", -1), ("max_seq_len", 1.5),
                                          ("num_blocks", 0), ("block_size", True)])
def test_invalid_config_is_rejected_by_name(field, value):
    kw = dict(max_batch_size=4, max_num_tokens=8, max_seq_len=64, num_blocks=16, block_size=4)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)


def test_token_budget_must_cover_a_decode_of_every_running_sequence():
    with pytest.raises(ValueError, match=r"max_num_tokens \(4\) must be >= max_batch_size \(8\)"):
        SchedulerConfig(max_batch_size=8, max_num_tokens=4, max_seq_len=64, num_blocks=16, block_size=4)


# ---------------------------------------------------------------------------- batches in flight (pp > 1)

def test_each_batch_in_flight_takes_its_share_and_no_sequence_is_in_two():
    scheduler, model = make_scheduler(max_num_tokens=16, max_batches_in_flight=2)
    for rid in "abcde":
        scheduler.add(Sequence(rid, [ord(rid), 2, 3], greedy(max_tokens=3)))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.request_id for s in first.seqs] == ["a", "b", "c"]  # ceil(5 / 2) of the 5 unfinished
    assert [s.request_id for s in second.seqs] == ["d"]  # max_batch_size 4: e waits
    assert scheduler.schedule().is_empty  # every running sequence is in flight
    scheduler.postprocess(first, [7, 7, 7])
    third = scheduler.schedule()
    assert [(s.request_id, n) for s, n in zip(third.seqs, third.num_new_tokens)] == [("a", 1), ("b", 1), ("c", 1)]


def test_abort_in_flight_frees_the_blocks_when_the_batch_is_back():
    scheduler, model = make_scheduler(max_num_tokens=16, num_blocks=8, max_batches_in_flight=2)
    a, b = Sequence("a", range(1, 10), greedy(max_tokens=4)), Sequence("b", [5, 6], greedy(max_tokens=4))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.seqs == (a,) and a.block_table == [0, 1, 2]
    assert scheduler.abort("a") is a
    assert not a.is_finished and a.block_table == [0, 1, 2] and scheduler.block_manager.num_free_blocks == 5
    with pytest.raises(ValueError, match="already in use"):  # until its batch is back
        scheduler.add(Sequence("a", [1], greedy()))
    scheduler.postprocess(batch, [7])
    assert a.finish_reason == "abort" and a.output_token_ids == [] and a.block_table == []
    assert scheduler.block_manager.num_free_blocks == 8 and list(scheduler.running) == []
    run_pipelined(scheduler, model)
    assert b.output_token_ids == reference_output([5, 6], 4)


def test_preemption_never_takes_a_sequence_in_flight():
    scheduler, model = make_scheduler(max_num_tokens=8, num_blocks=2, block_size=4, max_batches_in_flight=2)
    a, b = Sequence("a", [1, 2, 3, 4], greedy(max_tokens=2)), Sequence("b", [5, 6, 7, 8], greedy(max_tokens=2))
    scheduler.add(a)
    scheduler.add(b)
    first, second = [(batch, model.execute(build_step_metadata(batch, 4)))
                     for batch in (scheduler.schedule(), scheduler.schedule())]
    assert (first[0].seqs, second[0].seqs) == ((a,), (b,))
    scheduler.postprocess(first[0], Sampler().sample(first[1], [a])[0])
    # a's decode needs a second block and none is free; b, newer but in flight, keeps its block.
    assert scheduler.schedule().is_empty
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [a] and b.block_table == [1]
    scheduler.postprocess(second[0], Sampler().sample(second[1], [b])[0])
    run_pipelined(scheduler, model)
    assert a.output_token_ids == reference_output([1, 2, 3, 4], 2)
    assert b.output_token_ids == reference_output([5, 6, 7, 8], 2)


@pytest.mark.parametrize("depth", [2, 3])
def test_batches_in_flight_under_memory_pressure_match_the_reference(depth):
    scheduler, model = make_scheduler(max_batch_size=6, max_num_tokens=10, num_blocks=24, block_size=2,
                                      max_seq_len=40, max_batches_in_flight=depth)
    prompts = {f"r{i}": [3, 1, 4, 1, 5, 9][: 2 + i % 5] + list(range(i, i + 3 + i % 4)) for i in range(12)}
    for rid, prompt in prompts.items():
        scheduler.add(Sequence(rid, prompt, greedy(max_tokens=6 + int(rid[1:]) % 5)))
    seqs = dict(scheduler.requests)
    trace = run_pipelined(scheduler, model)
    assert max(len(batches) for batches in trace) == depth
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.prefix_cache_hits > 0
    for rid, seq in seqs.items():
        assert seq.output_token_ids == reference_output(prompts[rid], seq.params.max_tokens), rid
    assert scheduler.block_manager.num_free_blocks == 24 and not scheduler.in_flight


class OracleProposer:
    """Guesses the fake model's true continuation, except that every third guess it makes is wrong: a
    proposer with a known acceptance pattern, to drive the scheduler's speculative path."""

    def __init__(self):
        self.made = 0

    def propose(self, seqs, ks):
        from runtime.core.speculative import Proposal

        proposals = []
        for seq, k in zip(seqs, ks):
            tokens, guesses = list(seq.token_ids), []
            for _ in range(k):
                self.made += 1
                guess = next_token(tokens) if self.made % 3 else (next_token(tokens) + 1) % VOCAB
                guesses.append(guess)
                tokens.append(guess)
            proposals.append(Proposal(guesses))
        return proposals

    def release(self, seq):
        pass


def test_speculative_steps_keep_outputs_and_release_the_blocks_of_rejected_guesses():
    from runtime.core.speculative import SpeculativeConfig, Speculator

    scheduler, model = make_scheduler(max_batch_size=3, max_num_tokens=16, num_blocks=24, block_size=2)
    scheduler.speculator = Speculator(SpeculativeConfig(max_k=3, adaptive=False), OracleProposer())
    prompts = {"a": list(range(1, 10)), "b": [5, 6, 7], "c": list(range(20, 33)), "d": [9] * 6}
    for rid, prompt in prompts.items():
        scheduler.add(Sequence(rid, prompt, greedy(max_tokens=12)))
    seqs = dict(scheduler.requests)
    sampler, guessed = Sampler(), 0
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        meta = build_step_metadata(batch, scheduler.config.block_size)
        for i, seq in enumerate(batch.seqs):  # guesses sit after the last token, with a logits row each
            guessed += len(batch.guesses(i))
            assert batch.num_new_tokens[i] >= 1 + len(batch.guesses(i))
        tokens, _ = sampler.verify_batch(model.execute(meta), batch.sampling_seqs, batch.sampling_proposals)
        scheduler.postprocess(batch, tokens)
        for seq in scheduler.running:  # no block is kept for rejected guesses
            assert len(seq.block_table) <= scheduler.block_manager.blocks_needed(seq.num_tokens)
    for rid, prompt in prompts.items():
        assert seqs[rid].output_token_ids == reference_output(prompt, 12), rid
    stats = scheduler.speculator.stats
    assert guessed == stats.proposed_tokens > 0 and 0 < stats.accepted_tokens < stats.proposed_tokens
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.usage == 0


def test_step_metadata_keeps_its_numpy_arrays_in_the_executors_order():
    """build_step_metadata hands the executor the numpy arrays behind its tensors (so a replayed step copies
    them without converting again) and the largest position: both must be what the tensors say."""
    from runtime.backends.cpu.executor import _step_arrays

    scheduler, model = make_scheduler(max_num_tokens=12)
    for i, n in enumerate([3, 9, 5]):
        scheduler.add(Sequence(f"r{i}", list(range(1, n + 1)), greedy(max_tokens=6)))
    while scheduler.has_unfinished:
        _, meta = step(scheduler, model)
        expected = _step_arrays(meta)
        assert len(meta.host_arrays) == len(expected)
        for ours, theirs in zip(meta.host_arrays, expected):
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
        assert meta.max_position == int(meta.positions.max())
