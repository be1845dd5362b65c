"""Greedy chat agreement: the build's figure against a direct computation, and its gate."""

import json

import pytest
from conftest import exact_plan

from builder.measure.accuracy import GREEDY_TOKENS, reference_graph
from builder.build import build_engine
from builder.measure.calibration import GraphRunner, chat_prompts, shipped_text
from builder.errors import KilnError
from builder.sources import load_model
from runtime.format.engine_format import map_rank_file

# int8 weights on a tiny random model: about a third of its answers stay the float model's (int4
# weights change nearly all), so both the agreeing and the diverging cases are counted.
LOSSY = {"method": "int8"}


def test_the_shipped_prompts_are_many_and_distinct():
    prompts = [line for line in shipped_text("chat_prompts").splitlines() if line.strip()]
    assert len(prompts) >= 40 and len(set(prompts)) == len(prompts)


def test_agreement_equals_decoding_both_models_token_by_token(tiny_llama_dir, build_tiny_engine):
    engine = build_tiny_engine(tiny_llama_dir, "greedy-int8", **LOSSY)
    figures = json.loads((engine / "manifest.json").read_text())["accuracy"]
    model = load_model(str(tiny_llama_dir))
    prompts, _ = chat_prompts(model)
    stop = set(model.config.eos_token_ids)
    reference = GraphRunner(reference_graph(model))
    program, tensors = map_rank_file(engine / "rank0.engine")
    quantized = GraphRunner.from_program(json.loads(program), tensors, "f32", "f32")
    leading = []
    for ids in prompts:  # both decode one token a step over their own caches: no teacher forcing
        expected = reference.generate(ids, GREEDY_TOKENS, stop)
        got = quantized.generate(ids, GREEDY_TOKENS, stop)
        leading.append(next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected)))
    assert figures["greedy_leading"] == leading
    assert figures["greedy_prompts"] == len(prompts) and figures["greedy_tokens"] == GREEDY_TOKENS
    assert figures["greedy_mean_leading"] == pytest.approx(sum(leading) / len(prompts), rel=1e-6)
    agreeing = sum(n == GREEDY_TOKENS for n in leading)  # the tiny model has no EOS in its answers
    assert figures["greedy_agreement_pct"] == pytest.approx(100 * agreeing / len(prompts), rel=1e-6)
    assert 0 < agreeing < len(prompts), "the case should hold agreeing and diverging answers"


def test_a_gate_above_the_measured_agreement_fails_and_writes_nothing(tiny_llama_dir, tmp_path):
    out = tmp_path / "gated"
    with pytest.raises(KilnError) as failure:
        build_engine(str(tiny_llama_dir), exact_plan(**LOSSY, min_greedy_agreement=100.0), out, show_progress=False)
    message = str(failure.value)
    assert "min_greedy_agreement 100%" in message and "nothing was written" in message
    assert "of 48 chat prompts" in message and "identical leading tokens" in message
    assert "\n" not in message
    assert not out.exists()
    assert not list(tmp_path.iterdir())  # no temporary directory left beside it either
