"""[quant] activations: the integer paths' kernels, close to f32; "auto": every path measured at build, the gate's
allowed paths in the manifest, and the fastest of them chosen on the host that serves the engine."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from builder.graph.interpret import Interpreter
from runtime.backends.activations import CANDIDATES, MIN_GAIN, worth_timing
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import EngineError, map_rank_file
from runtime.ops import linear
from runtime.core.sampling import SamplingParams


def test_int8_activations_are_recorded_and_stay_close(tiny_llama_dir, build_tiny_engine):
    exact = build_tiny_engine(tiny_llama_dir, "int8-f32", method="int8")
    fast = build_tiny_engine(tiny_llama_dir, "int8-int8", method="int8", activations="int8")
    program, tensors = map_rank_file(fast / "rank0.engine")
    acts = {n["name"]: n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"}
    assert acts["layers.0.self_attn.qkv_proj"] == "int8" and acts["layers.0.mlp.down_proj"] == "int8"
    ids = [3, 17, 99, 4, 250, 8, 41, 7]
    ours = Interpreter(program, tensors, all_logits=True).logits(ids)
    reference = Interpreter(*map_rank_file(exact / "rank0.engine"), all_logits=True).logits(ids)
    assert not torch.equal(ours, reference)  # a different kernel really ran
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_default_engine_answers_chat_prompts_as_the_float_model(smollm2_default_engine):
    """The default engine (the GGUF's blocks, f32 activations, f16 KV cache) is evaluated at build time
    against the same weights in float32: perplexity, KL and greedy chat answers."""
    manifest = json.loads((smollm2_default_engine / "manifest.json").read_text())
    accuracy = manifest["accuracy"]
    assert (accuracy["activations"], accuracy["kv_cache_dtype"]) == ("f32", "f16")
    assert abs(accuracy["ppl_increase_pct"]) < 0.01 and 0 < accuracy["kl_mean"] < 1e-5
    assert accuracy["greedy_chat_template"] and accuracy["greedy_prompts"] >= 40
    assert accuracy["greedy_agreement_pct"] >= 95.0  # the bar; int8 activations reach 48%
    program, _ = map_rank_file(smollm2_default_engine / "rank0.engine")
    nodes = json.loads(program)["nodes"]
    assert {n["attrs"].get("act") for n in nodes if n["op"] in ("linear", "logits")} == {None}


def test_int16_and_int12_activations_take_their_kernels_and_stay_closer_than_int8(tiny_llama_dir, build_tiny_engine):
    exact = build_tiny_engine(tiny_llama_dir, "int4-f32", method="int4")
    ids = [3, 17, 99, 4, 250, 8, 41, 7] * 5  # 40 tokens: int12 takes AMX's joined tiles where it has them
    reference = Interpreter(*map_rank_file(exact / "rank0.engine"), all_logits=True).logits(ids)
    errors = {}
    for act in ("int16", "int12", "int8"):
        engine = build_tiny_engine(tiny_llama_dir, f"int4-{act}", method="int4", activations=act)
        program, tensors = map_rank_file(engine / "rank0.engine")
        acts = {n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"}
        assert acts == {act}
        errors[act] = (Interpreter(program, tensors, all_logits=True).logits(ids) - reference).abs().max()
    assert 0 < errors["int16"] < errors["int8"] / 50  # 8 more bits: about 256x less rounding
    assert errors["int16"] < errors["int12"] / 4 and errors["int12"] < errors["int8"] / 4  # 4 bits apart: ~16x


def test_auto_times_every_path_and_builds_the_chosen_one(tiny_llama_dir, build_tiny_engine):
    """activations = "auto": each path timed on this host and measured; with no gate the fastest is taken, and the
    engine, its plan and its accuracy figures are the chosen path's."""
    engine = build_tiny_engine(tiny_llama_dir, "int4-auto", method="int4", activations="auto", min_greedy_agreement=0,
                               max_ppl_increase=100)
    manifest = json.loads((engine / "manifest.json").read_text())
    choice = manifest["activation_choice"]
    paths = {row["activations"]: row for row in choice["paths"]}
    assert set(paths) == {"f32", "int16", "int12", "int8"}
    assert choice["gate_greedy_agreement_pct"] == 0
    assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in paths.values())
    # int4 rounds the float weights: every path is measured against the float model
    assert not any(row["exact"] for row in paths.values())
    assert all(0 <= row["greedy_agreement_pct"] <= 100 and row["kl_mean"] > 0 for row in paths.values())
    chosen = choice["chosen"]
    score = {m: (r["decode_tok_s"] / paths["f32"]["decode_tok_s"] * r["prefill_tok_s"] / paths["f32"]["prefill_tok_s"])
             ** 0.5 for m, r in paths.items()}

    def outcomes(best: str, rest: list[str]) -> set[str]:
        """Each coarser path taken if it gains MIN_GAIN over the path taken before it; the manifest's speeds
        are rounded, so right at the margin either outcome is right."""
        if not rest:
            return {best}
        ratio = score[rest[0]] / score[best]
        took = outcomes(rest[0], rest[1:]) if ratio >= MIN_GAIN - 0.01 else set()
        kept = outcomes(best, rest[1:]) if ratio < MIN_GAIN + 0.01 else set()
        return took | kept

    # the build times int12 apart from int16 only where AMX tiles make it faster (worth_timing), as the test does
    timed = worth_timing([m for m in CANDIDATES if m in paths])
    assert chosen in outcomes("f32", timed[1:]) and chosen in choice["why"]
    assert choice["allowed"] == [m for m in CANDIDATES if m in paths]  # no gate: every path
    # the bytes do not follow the timing: the program runs f32 until the serving host picks its path
    assert manifest["plan"]["quant"]["activations"] == "auto" and manifest["accuracy"]["activations"] == "f32"
    program, _ = map_rank_file(engine / "rank0.engine")
    assert {n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"} == {None}


def test_a_rank_built_alone_under_auto_is_the_whole_builds_rank(tiny_llama_dir, tmp_path):
    from builder.build import build_engine
    from conftest import exact_plan

    plan = exact_plan(method="int4", activations="auto", min_greedy_agreement=0).with_overrides(tp=2)
    whole = build_engine(str(tiny_llama_dir), plan, tmp_path / "whole", show_progress=False)
    build_engine(str(tiny_llama_dir), plan, tmp_path / "apart", show_progress=False, rank=1)
    assert (tmp_path / "apart" / "rank1.engine").read_bytes() == (whole.out / "rank1.engine").read_bytes()


# ---------------------------------------------------------------------------- the path chosen on the serving host

OPTIONS = EngineOptions(kv_cache_gib=0.05, max_batch_size=8)
CHAT = ["What is the capital of France?", "Write one sentence about the sea.", "List three colors.",
        "Name a large animal.", "Count from one to five."]


def allowed_of(engine) -> list[str]:
    return json.loads((engine / "manifest.json").read_text())["activation_choice"]["allowed"]


def test_auto_allows_the_paths_that_answer_as_f32_does(smollm2_default_engine):
    manifest = json.loads((smollm2_default_engine / "manifest.json").read_text())
    choice = manifest["activation_choice"]
    paths = {row["activations"]: row for row in choice["paths"]}
    f32 = paths["f32"]
    assert choice["gate_greedy_agreement_pct"] == f32["greedy_agreement_pct"]
    for mode, row in paths.items():
        keeps = (row["greedy_agreement_pct"] >= f32["greedy_agreement_pct"]
                 and row["ppl_increase_pct"] <= f32["ppl_increase_pct"] + 0.01)
        assert (mode in choice["allowed"]) == keeps, (mode, row)
    assert "f32" in choice["allowed"] and "int16" in choice["allowed"]  # int16 changes no answer of SmolLM2's
    assert "int8" not in choice["allowed"]  # it answers about 40% of the prompts as f32 does
    assert manifest["plan"]["quant"]["activations"] == "auto" and choice["chosen"] in choice["allowed"]


def test_the_serving_host_times_the_allowed_paths_once_and_refuses_others(smollm2_default_engine, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    allowed = allowed_of(smollm2_default_engine)
    timed = [m for m in allowed if m != "int12" or linear.isa() == "amx"]  # elsewhere int12 runs int16's kernels
    choice = LLMEngine.from_dir(smollm2_default_engine, OPTIONS).engine.activation_choice
    assert choice.activations in timed and set(choice.scores) == set(timed) and not choice.cached
    assert choice.scores["f32"] == 1.0 and all(score > 0 for score in choice.scores.values())
    again = LLMEngine.from_dir(smollm2_default_engine, OPTIONS).engine.activation_choice
    assert again.cached and (again.activations, again.scores) == (choice.activations, choice.scores)
    with pytest.raises(EngineError, match=rf"^--activations int8: the build allowed {', '.join(allowed)} "):
        LLMEngine.from_dir(smollm2_default_engine, dataclasses.replace(OPTIONS, activations="int8"))
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(smollm2_default_engine), "-p", "Hi",
                           "--activations", "int8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("engine-run: error: --activations int8: the build allowed")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("path", ["int16", "int8"])
def test_a_path_chosen_at_start_up_computes_as_a_build_of_that_path(path, tiny_llama_dir, build_tiny_engine):
    auto = build_tiny_engine(tiny_llama_dir, f"int4-auto-{path}", method="int4", activations="auto",
                             min_greedy_agreement=0, max_ppl_increase=100)
    pinned = build_tiny_engine(tiny_llama_dir, f"int4-{path}-pinned", method="int4", activations=path)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True, ignore_eos=True)
    chosen = LLMEngine.from_dir(auto, dataclasses.replace(OPTIONS, activations=path))
    assert chosen.engine.activation_choice.activations == path
    got = [(o.token_ids, o.logprobs) for o in chosen.generate([[3, 17, 99, 4], [250, 8, 41, 7, 12]], params)]
    want = LLMEngine.from_dir(pinned, OPTIONS).generate([[3, 17, 99, 4], [250, 8, 41, 7, 12]], params)
    assert got == [(o.token_ids, o.logprobs) for o in want]


@pytest.mark.parametrize("mode", ["f32", "int16"])
def test_a_requests_tokens_do_not_depend_on_the_requests_beside_it(smollm2_default_engine, mode):
    # Alone, then in steps shared with four others (their prompt chunks beside its decodes: other row counts,
    # other kernel tiles). int16 quantizes each token's activations alone and sums integers: the same bits. The
    # f32 kernels add a row's products in another order at up to 12 rows a step (AVX-512: the direct path) than
    # in tiles, so its log-probabilities move in the last bits (here by up to 1.3e-4 after 18 tokens), its tokens not.
    llm = LLMEngine.from_dir(smollm2_default_engine, dataclasses.replace(OPTIONS, activations=mode))
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, ignore_eos=True)
    texts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    alone = llm.generate(texts[:1], params)[0]
    crowded = llm.generate(texts[1:3] + texts[:1] + texts[3:], params)[2]
    assert crowded.token_ids == alone.token_ids
    if mode == "f32":
        torch.testing.assert_close(crowded.logprobs, alone.logprobs, atol=1e-3, rtol=0)
    else:
        assert crowded.logprobs == alone.logprobs
