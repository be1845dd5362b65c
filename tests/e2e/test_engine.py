"""LLMEngine on real engines: in-flight batching, preemption, prefix reuse, bad input, golden output."""

import pytest
import torch

from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts_of_mixed_lengths(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (int(torch.randint(1, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "tiny")


def engine(path, **options) -> LLMEngine:
    options.setdefault("kv_cache_gib", 0.02)
    return LLMEngine.from_dir(path, EngineOptions(**options))


def alone(path, prompt, params=GREEDY) -> list[int]:
    return engine(path).generate([prompt], params)[0].token_ids


def run_staggered(llm: LLMEngine, prompts, params=GREEDY, every: int = 2) -> dict[str, list[int]]:
    """Add one prompt every `every` steps while the others run; returns output ids by request."""
    pending = list(enumerate(prompts))
    outputs, step = {}, 0
    while pending or llm.has_unfinished():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            llm.add_request(p, params, request_id=str(i))
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
    return outputs


def test_sixteen_staggered_prompts_match_each_alone(tiny_engine_dir):
    prompts = prompts_of_mixed_lengths(16, 250)
    llm = engine(tiny_engine_dir, max_num_tokens=64)  # forces chunked prefill of the long prompts
    outputs = run_staggered(llm, prompts)
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == alone(tiny_engine_dir, p), f"prompt {i} ({len(p)} tokens)"
    assert llm.stats().num_running == 0 and llm.scheduler.block_manager.usage == 0


def test_preemption_gives_identical_outputs(tiny_engine_dir):
    prompts = prompts_of_mixed_lengths(8, 250)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = run_staggered(engine(tiny_engine_dir), prompts, params, every=1)
    # 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes = 512 B/token (tiny_llama has 4 layers: 1 KiB)
    tight = engine(tiny_engine_dir, kv_cache_gib=24 * 16 * 1024 / 2**30)  # 24 blocks of 16 tokens
    squeezed = run_staggered(tight, prompts, params, every=1)
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == roomy


def test_repeated_prefix_is_served_from_cache(tiny_engine_dir):
    llm = engine(tiny_engine_dir)
    prefix = list(range(10, 74))  # 4 full blocks
    first = llm.generate([prefix + [5, 6, 7]], GREEDY)[0]
    second = llm.generate([prefix + [5, 6, 7]], GREEDY)[0]
    other = llm.generate([prefix + [9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 64 and other.num_cached_tokens == 64
    assert second.token_ids == first.token_ids
    assert other.token_ids == alone(tiny_engine_dir, prefix + [9])


def test_seeded_sampling_is_independent_of_the_batch(tiny_engine_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    solo = engine(tiny_engine_dir).generate([[5, 6, 7]], params)[0].token_ids
    crowd = engine(tiny_engine_dir).generate([[9, 9], [5, 6, 7], [1] * 30], [GREEDY, params, params])
    assert crowd[1].token_ids == solo


def test_stop_strings_end_the_text(tiny_engine_dir):
    llm = engine(tiny_engine_dir)
    full = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_bad_requests_are_refused_before_taking_blocks(tiny_engine_dir):
    llm = engine(tiny_engine_dir, max_seq_len=64)
    llm.add_request([5] * 10, GREEDY, request_id="good")
    free = llm.scheduler.block_manager.num_free_blocks
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        llm.add_request([5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.add_request([10**6], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert llm.scheduler.block_manager.num_free_blocks == free
    outs = llm.generate([[5] * 10], GREEDY)  # the engine keeps serving
    assert len(outs[0].token_ids) == GREEDY.max_tokens


def test_abort_frees_blocks_at_once(tiny_engine_dir):
    llm = engine(tiny_engine_dir)
    free = llm.scheduler.block_manager.num_free_blocks
    llm.add_request(list(range(3, 60)), SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    llm.add_request([4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="b")
    llm.step()
    assert llm.scheduler.block_manager.num_free_blocks < free
    assert llm.abort("a")
    assert not llm.abort("a")
    finished = []
    while llm.has_unfinished():
        finished += [o.request_id for o in llm.step() if o.finished]
    assert finished == ["b"]
    assert llm.scheduler.block_manager.num_free_blocks == free


class TwoStages:
    """A one-rank executor behind the pipelined protocol (as a pp=2 Rank): submit runs a step, collect
    returns its logits, or fails for a step holding `poison` among its tokens."""

    max_in_flight = 2

    def __init__(self, executor, poison: int):
        self.executor, self.cache, self.poison = executor, executor.cache, poison

    def submit(self, meta):
        return self.executor.execute(meta), self.poison in meta.token_ids.tolist()

    def collect(self, handle):
        logits, failed = handle
        if failed:
            raise RuntimeError("stage 1 failed")
        return logits


def test_a_pipelined_executor_keeps_two_batches_in_flight_and_a_failed_batch_ends_only_its_requests(
        tiny_engine_dir):
    prompts = prompts_of_mixed_lengths(8, 250)
    one_at_a_time = run_staggered(engine(tiny_engine_dir, max_num_tokens=64), prompts)
    base = engine(tiny_engine_dir, max_num_tokens=64)
    llm = LLMEngine(base.engine, base.options, executor=TwoStages(base.executor, poison=251))
    outputs = {}
    for i, p in enumerate(prompts + [[251, 252]]):
        llm.add_request(p, GREEDY, request_id=str(i))
        for out in llm.step():
            outputs[out.request_id] = out
    while llm.has_unfinished():
        outputs.update((out.request_id, out) for out in llm.step())
    failed = {rid for rid, out in outputs.items() if out.finish_reason == "error"}
    assert "8" in failed and len(failed) < len(outputs)
    assert all(out.token_ids == one_at_a_time[rid] for rid, out in outputs.items() if rid not in failed)
    assert llm.stats().peak_batches_in_flight == 2 and llm.scheduler.block_manager.usage == 0


def test_limits_can_be_lowered_not_raised(tiny_engine_dir):
    from runtime.format.engine_format import EngineError

    assert engine(tiny_engine_dir, max_batch_size=4).scheduler.config.max_batch_size == 4
    with pytest.raises(EngineError, match="max_batch_size=999"):
        engine(tiny_engine_dir, max_batch_size=999)


GOLDEN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short story about a robot who learns to paint:",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


def test_smollm2_greedy_matches_transformers(smollm2_exact_engine, smollm2_gguf):
    from builder.verify import load_transformers_model

    reference = load_transformers_model(str(smollm2_gguf))
    llm = LLMEngine.from_dir(smollm2_exact_engine, EngineOptions(kv_cache_gib=0.25))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = llm.generate(GOLDEN_PROMPTS, params)
    for prompt, out in zip(GOLDEN_PROMPTS, ours):
        ids, cache, expected = llm.encode(prompt), None, []
        # Plain greedy steps on transformers' KV cache, EOS included (generate() would stop or mask it).
        with torch.inference_mode():
            while len(expected) < 32:
                step = reference(torch.tensor([ids]), past_key_values=cache, use_cache=True)
                expected.append(int(step.logits[0, -1].argmax()))
                ids, cache = expected[-1:], step.past_key_values
        assert out.token_ids == expected, prompt


def test_executor_fuses_attention_chains_and_matches_the_reference_interpreter(tiny_engine_dir):
    """The executor binds each layer's split -> rope -> attention as one C call (qkv_attention); its
    logits over a paged prefill equal the reference interpreter's (op by op, dense attention)."""
    from builder.graph.interpret import Interpreter
    from runtime.backends import open_engine
    from runtime.backends.cpu.executor import CpuExecutor
    from runtime.backends.step import StepMetadata

    rank = open_engine(tiny_engine_dir).load_rank(0)
    executor = CpuExecutor(rank, pools=8, block_size=16)
    nodes = executor.program.doc["nodes"]
    layers = sum(n["op"] == "attention" for n in nodes)
    assert layers >= 2 and len(executor.program.calls) == len(nodes) - 2 * layers  # split and rope folded in

    ids = prompts_of_mixed_lengths(1, 100)[0] * 3
    t = len(ids)
    meta = StepMetadata(token_ids=torch.tensor(ids), positions=torch.arange(t), slot_mapping=torch.arange(t) + 16,
                        block_tables=torch.tensor([[1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)[:, :(t + 15) // 16],
                        context_lens=torch.tensor([t], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, t], dtype=torch.int32), logits_indices=torch.arange(t))
    ours = executor.execute(meta)
    expected = Interpreter(rank.program, rank.tensors, all_logits=True).logits(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
