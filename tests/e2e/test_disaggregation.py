"""Prefill/decode disaggregation between two engines: K/V handed over byte for byte, output unchanged."""

import dataclasses

import pytest
import torch

from runtime.core.disaggregation import _slots
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "pd-tiny")


def engine(path, **options) -> LLMEngine:
    options.setdefault("kv_cache_gib", 0.02)
    return LLMEngine.from_dir(path, EngineOptions(**options))


def mixed_prompts() -> list[list[int]]:
    """Lengths around the block size (16): shorter than a block, exactly one, several, several and a bit."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (1, 5, 15, 16, 17, 32, 47, 100)]


def cache_bytes(llm: LLMEngine, block_table: list[int], start: int, stop: int) -> list[bytes]:
    """The bytes a cache holds for positions [start, stop) of a block table, K and V of every layer."""
    cache, layout = llm.executor.cache, llm.kv_layout
    slots = _slots(block_table, layout.block_size, start, stop)
    return [t.view(-1, *t.shape[2:])[slots].contiguous().view(torch.uint8).numpy().tobytes()
            for layer in layout.layers for t in (cache.k[layer], cache.v[layer])]


def handoff_bytes(handoff, start: int) -> list[bytes]:
    n = len(handoff.prompt_token_ids)
    out = []
    for k, v in zip(handoff.k, handoff.v):
        for data in (k, v):
            row = data.nbytes // n
            out.append(data.reshape(-1)[start * row:].tobytes())
    return out


def prefill(llm: LLMEngine, prompts, params=GREEDY):
    outs = {}
    ids = [llm.add_request(p, params, hand_off=True) for p in prompts]
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[i] for i in ids]


def test_decoding_from_handed_over_kv_gives_the_colocated_output(engine_dir):
    prompts = mixed_prompts()
    colocated = engine(engine_dir).generate(prompts, GREEDY)
    prefiller, decoder = engine(engine_dir), engine(engine_dir)
    firsts = prefill(prefiller, prompts)
    assert [o.token_ids for o in firsts] == [c.token_ids[:1] for c in colocated]
    for out, prompt in zip(firsts, prompts):
        handoff = out.kv_handoff
        assert handoff is not None and handoff.prompt_token_ids == prompt
        # Byte for byte what the prefill engine wrote: its blocks still hold it (freed, nothing since reused them).
        assert handoff_bytes(handoff, 0) == cache_bytes(prefiller, list(handoff.source_blocks), 0, len(prompt))
    ids = [decoder.add_prefilled(o.kv_handoff, GREEDY) for o in firsts]
    seqs = [decoder.scheduler.requests[i] for i in ids]
    for seq, out in zip(seqs, firsts):  # in the decode engine's own blocks, before any step
        n = seq.num_prompt_tokens
        assert handoff_bytes(out.kv_handoff, 0) == cache_bytes(decoder, seq.block_table, 0, n)
        assert seq.num_computed_tokens == n and seq.output_token_ids == out.token_ids
    final = {}
    while decoder.has_unfinished():
        for out in decoder.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[i].token_ids for i in ids] == [c.token_ids for c in colocated]
    assert [final[i].text for i in ids] == [c.text for c in colocated]
    assert decoder.stats().prompt_tokens == sum(map(len, prompts))


def test_a_decode_engine_reuses_its_cached_prefix_and_queues_what_does_not_fit(engine_dir):
    shared = mixed_prompts()[-1]  # 100 tokens: six full blocks
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    colocated = engine(engine_dir).generate(prompts, GREEDY)
    firsts = prefill(engine(engine_dir), prompts)
    decoder = engine(engine_dir)
    a = decoder.add_prefilled(firsts[0].kv_handoff, GREEDY)
    decoder.generate([[5, 6]], dataclasses.replace(GREEDY, max_tokens=2))  # a step: a's blocks become cached
    b = decoder.add_prefilled(firsts[1].kv_handoff, GREEDY)
    assert decoder.scheduler.requests[b].num_cached_tokens == 96  # the shared six blocks, not written again
    # Too little room: the request waits and is recomputed from its tokens, with the same answer.
    small = engine(engine_dir, kv_cache_gib=8 * 16 * 1024 / 2**30, max_batch_size=1)
    c = small.add_prefilled(firsts[0].kv_handoff, GREEDY)
    d = small.add_prefilled(firsts[1].kv_handoff, GREEDY)
    assert small.scheduler.requests[d] in small.scheduler.waiting
    results = {}
    for llm in (decoder, small):
        while llm.has_unfinished():
            results.update({o.request_id + str(id(llm)): o for o in llm.step() if o.finished})
    assert results[a + str(id(decoder))].token_ids == colocated[0].token_ids
    assert results[b + str(id(decoder))].token_ids == colocated[1].token_ids
    assert results[c + str(id(small))].token_ids == colocated[0].token_ids
    assert results[d + str(id(small))].token_ids == colocated[1].token_ids


def test_seeded_sampling_continues_across_the_handover(engine_dir):
    prompts = mixed_prompts()[3:6]
    params = SamplingParams(temperature=0.8, seed=77, max_tokens=20, ignore_eos=True)
    colocated = engine(engine_dir).generate(prompts, params)
    decoder = engine(engine_dir)
    ids = [decoder.add_prefilled(o.kv_handoff, params) for o in prefill(engine(engine_dir), prompts, params)]
    final = {}
    while decoder.has_unfinished():
        final.update({o.request_id: o for o in decoder.step() if o.finished})
    assert [final[i].token_ids for i in ids] == [c.token_ids for c in colocated]


def test_handoffs_that_do_not_fit_are_one_line_errors(engine_dir, tiny_llama_tied_dir, build_tiny_engine):
    handoff = prefill(engine(engine_dir), [[5, 6, 7]])[0].kv_handoff
    other = engine(build_tiny_engine(tiny_llama_tied_dir, "pd-other"))
    with pytest.raises(ValueError, match="does not fit this engine's cache"):
        other.add_prefilled(handoff, GREEDY)
    with pytest.raises(ValueError, match="nothing is left to decode"):
        engine(engine_dir).add_prefilled(handoff, dataclasses.replace(GREEDY, max_tokens=1))
