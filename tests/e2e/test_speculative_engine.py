"""Speculative decoding in the engine: guesses verified inside in-flight batching, by the n-gram and the
draft-engine proposers, against the same engine without speculation."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams
from runtime.core.speculative import SpeculativeConfig

from tests.e2e.test_engine import run_staggered
from tests.e2e.test_server import MODEL, ServerProcess

# The n-gram tests guess whenever the n-gram has a guess, so that what they count does not hang on timing:
# adaptive k reads measured step times, and a run whose first guesses fail may stop guessing for the rest
# of a short request. The draft tests keep adaptive k (the int8 draft's guesses mostly stand).
NGRAM = SpeculativeConfig(proposer="ngram", max_k=4, adaptive=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

# The chi-square statistic over the 9 cells of (first, second) token pairs has 8 degrees of freedom;
# it exceeds 26.12 with probability 0.001 when the draws follow the expected distribution. The seeds
# are fixed, so the test is deterministic; a wrong acceptance rule (every guess kept, or the rows
# misaligned with the guesses they score) moves the statistic far beyond it (see
# tests/unit/test_speculative.py for the rule alone).
CHI2_8DOF_999 = 26.12


@pytest.fixture(scope="module")
def target_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "spec-target")


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, build_tiny_engine):
    """The same checkpoint with int8 weights (logits too: every op a C kernel, so steps replay): a draft that
    mostly agrees with the target, and shares its tokenizer."""
    return build_tiny_engine(tiny_llama_dir, "spec-draft", method="int8", exclude=[])


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory, build_tiny_engine):
    from tests.conftest import make_tiny_llama

    return build_tiny_engine(make_tiny_llama(tmp_path_factory.mktemp("other"), seed=11, vocab_size=288), "other-vocab")


def engine(path, speculative=None, **options) -> LLMEngine:
    options.setdefault("kv_cache_gib", 0.02)
    return LLMEngine.from_dir(path, EngineOptions(speculative=speculative, **options))


def mixed_prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts of mixed lengths: some repeat a phrase (n-gram hits), some share a 40-token prefix (prefix-cache
    hits), some are random."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = []
    for i in range(n):
        tail = torch.randint(3, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        if i % 3 == 0:
            prompts.append(tail * 3)
        elif i % 3 == 1:
            prompts.append(shared + tail)
        else:
            prompts.append(tail + tail[:5])
    return prompts


def assert_all_blocks_free(llm: LLMEngine) -> None:
    bm = llm.scheduler.block_manager
    assert llm.stats().num_running == 0 and bm.usage == 0
    assert all(block.ref_count == 0 for block in bm.blocks)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_output_is_the_same_with_speculation(target_dir, draft_dir, proposer):
    prompts = mixed_prompts(12, 250)
    plain = run_staggered(engine(target_dir, kv_cache_gib=1 / 1024), prompts, GREEDY, every=1)
    config = NGRAM if proposer == "ngram" else SpeculativeConfig(proposer="draft", draft_engine=str(draft_dir))
    # 24 blocks of 16 tokens for 12 requests of up to 130 tokens: preemption is certain
    tight = engine(target_dir, config, kv_cache_gib=24 * 16 * 1024 / 2**30)
    speculated = run_staggered(tight, prompts, GREEDY, every=1)
    assert speculated == plain
    stats = tight.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_tokens_per_step > 1.0, stats
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0, stats
    assert_all_blocks_free(tight)
    if proposer == "draft":  # the draft's own cache is released with its sequences
        assert tight.speculator.proposer.blocks.usage == 0 and not tight.speculator.proposer.seqs


def test_verify_steps_are_recorded_and_replayed(draft_dir):
    """An engine of C kernels (int8 weights) replays its steps: the k + 1-token verify steps too."""
    prompts = [p * 4 for p in mixed_prompts(3, 250)]
    plain = engine(draft_dir).generate(prompts, GREEDY)
    llm = engine(draft_dir, NGRAM)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    executor = llm.executor
    verify_shapes = [shape for shape in executor.tapes if shape[2] > shape[1]]  # more logits rows than sequences
    assert executor.replayed_steps > 0 and verify_shapes, (executor.replayed_steps, list(executor.tapes))


def test_requests_that_opt_out_or_use_penalties_decode_one_token_a_step(target_dir):
    llm = engine(target_dir, NGRAM)
    prompt = mixed_prompts(1, 250)[0]
    outs = llm.generate([prompt] * 3, [GREEDY, SamplingParams(temperature=0.0, max_tokens=40, speculative=False,
                                                              ignore_eos=True),
                                       SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3,
                                                      ignore_eos=True)])
    assert outs[0].num_proposed_tokens > 0 and outs[0].num_accepted_tokens > 0
    assert outs[1].num_proposed_tokens == 0 and outs[2].num_proposed_tokens == 0
    assert outs[1].token_ids == outs[0].token_ids


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_sampled_requests_give_their_non_speculative_text(target_dir, draft_dir, proposer):
    """Every output position samples with noise of its own (from the seed and the position), and a guess
    stands only where it equals the target's draw: through speculation, preemption and prefix-cache hits, a
    seeded request gives the text it gives without them, and gives it again, whatever k adaptivity chose."""
    prompts = mixed_prompts(12, 250)
    # Cool enough that the n-gram's guesses of this random model's continuations sometimes stand.
    params = SamplingParams(temperature=0.3, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
    plain = run_staggered(engine(target_dir, kv_cache_gib=1 / 1024), prompts, params, every=1)
    assert plain != run_staggered(engine(target_dir, kv_cache_gib=1 / 1024), prompts, GREEDY, every=1)  # sampling
    config = NGRAM if proposer == "ngram" else SpeculativeConfig(proposer="draft", draft_engine=str(draft_dir))
    for _ in range(2):
        tight = engine(target_dir, config, kv_cache_gib=24 * 16 * 1024 / 2**30)
        assert run_staggered(tight, prompts, params, every=1) == plain
        stats = tight.stats()
        assert stats.spec_accepted_tokens > 0 and stats.num_preemptions > 0, stats


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_keep_the_target_distribution(target_dir, draft_dir, proposer):
    """Over 1500 seeds, the first two sampled tokens (temperature 1, top-k 3: 9 possible pairs) follow the
    distribution the target's own logits give; the second token always comes from a verify step."""
    vocab = 250
    prompt = torch.randperm(vocab, generator=torch.Generator().manual_seed(2)).tolist()  # every token once
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    reference = engine(target_dir, kv_cache_gib=0.05)

    def top3(ids):  # the target's top-3 tokens after ids and their renormalised probabilities
        out = reference.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=True))[0]
        logits = reference_logits(reference, ids)
        values, tokens = logits.topk(3)
        assert int(tokens[0]) == out.token_ids[0]
        return tokens.tolist(), torch.softmax(values.double(), dim=-1)

    firsts, p1 = top3(prompt)
    expected = {}
    for t1, q1 in zip(firsts, p1.tolist()):
        seconds, p2 = top3(prompt + [t1])
        for t2, q2 in zip(seconds, p2.tolist()):
            expected[(t1, t2)] = q1 * q2
    config = SpeculativeConfig(proposer=proposer, max_k=1, adaptive=False,
                               draft_engine=str(draft_dir) if proposer == "draft" else None)
    llm = engine(target_dir, config, kv_cache_gib=0.05)
    draws = 1500
    outs = llm.generate([prompt] * draws, [dataclasses.replace(params, seed=s) for s in range(draws)])
    counts = {pair: 0 for pair in expected}
    for out in outs:
        counts[tuple(out.token_ids[:2])] += 1  # a KeyError here: a pair outside the target's top 3
    verified = sum(1 for out in outs if out.num_proposed_tokens)
    assert verified == draws, f"only {verified} of {draws} requests had their second token verified"
    chi2 = sum((counts[c] - draws * e) ** 2 / (draws * e) for c, e in expected.items())
    assert chi2 < CHI2_8DOF_999, (chi2, counts, expected)


def reference_logits(llm: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The target's logits after ids, straight from its executor (one prefill step of a fresh sequence)."""
    from runtime.core.scheduler import ScheduledBatch
    from runtime.core.sequence import Sequence
    from runtime.backends.step import build_step_metadata

    seq = Sequence("reference", ids)
    bm = llm.scheduler.block_manager
    bm.allocate(seq)
    seq.num_computed_tokens = 0
    try:
        batch = ScheduledBatch((seq,), (len(ids),), (True,))
        return llm.executor.execute(build_step_metadata(batch, llm.block_size))[0].float().clone()
    finally:
        bm.free(seq)


def test_bad_speculation_settings_are_one_line_errors(target_dir, other_tokenizer_dir):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(target_dir), "-p", "hi",
                               "--max-tokens", "4", *args], capture_output=True, text=True, timeout=120)

    bad = run("--speculative", "medusa")
    assert bad.returncode != 0 and "choose one of ngram, draft" in bad.stderr and len(bad.stderr.splitlines()) == 1
    bad = run("--draft", str(other_tokenizer_dir))
    assert bad.returncode != 0 and "tokenizer differs" in bad.stderr and len(bad.stderr.splitlines()) == 1
    good = run("--speculative", "ngram")
    assert good.returncode == 0 and good.stdout.strip() == run().stdout.strip()


def test_server_reports_acceptance_and_lets_requests_opt_out(target_dir, tmp_path):
    import httpx

    server = ServerProcess(target_dir, tmp_path / "server.log", "--speculative", "ngram", "--fixed-k")
    try:
        body = {"model": MODEL, "prompt": mixed_prompts(1, 250)[0], "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        opted_out = httpx.post(f"{server.url}/v1/completions", json={**body, "speculative": False}, timeout=60)
        assert opted_out.status_code == 200 and server.metric("kiln_spec_proposed_tokens_total") == 0
        speculated = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert speculated.json()["choices"][0]["text"] == opted_out.json()["choices"][0]["text"]
        assert server.metric("kiln_spec_proposed_tokens_total") > 0
        assert 0 < server.metric("kiln_spec_acceptance_rate") <= 1
        assert server.metric("kiln_spec_tokens_per_step") > 1
    finally:
        assert server.stop() == 0, server.log()
