"""top_logprobs on the exact engine (SmolLM2's GGUF blocks computed in f32) against transformers on the same
dequantized weights: at every generated position, the chosen token's log-prob and the 20 most likely tokens,
values and order, equal transformers' log_softmax within 1e-4."""

import pytest
import torch

from builder.verify import load_transformers_model
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import MAX_TOP_LOGPROBS, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    return load_transformers_model(str(smollm2_gguf))


def test_top_logprobs_equal_transformers_log_softmax(smollm2_exact_engine, reference):
    llm = LLMEngine.from_dir(smollm2_exact_engine, EngineOptions(kv_cache_gib=0.05))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, top_logprobs=MAX_TOP_LOGPROBS)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ids = llm.encode(prompt)
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + out.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)  # the positions that chose each token
        assert all(type(lp) is float for lp in out.logprobs)  # plain floats; the alternatives apart
        for position, (token, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
            want = expected[position]
            assert abs(lp - want[token].item()) < TOLERANCE, (prompt, position)
            values, order = torch.sort(want, descending=True, stable=True)
            ours = [t for t, _ in top]
            theirs = order[:MAX_TOP_LOGPROBS].tolist()
            # the same tokens in the same order, but for neighbours closer than the tolerance, which may swap
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert a == b or abs(want[a].item() - want[b].item()) < TOLERANCE, (prompt, position, i)
            assert [v for _, v in top] == pytest.approx(values[:MAX_TOP_LOGPROBS].tolist(), abs=TOLERANCE)
