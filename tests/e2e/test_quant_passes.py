"""Quantization passes: rewrites, AWQ, KV cache scales, the accuracy figures and gate, GGUF source blocks."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.build import build_engine
from builder.measure.calibration import GraphRunner, shipped_text, windows
from builder.errors import KilnError
from builder.graph.interpret import Interpreter
from builder.graph.ir import verify
from builder.sources import load_model
from builder.quant.packing import pack_graph
from builder.graph.trace import trace
from conftest import exact_plan, make_tiny_llama
from passes.context import PassContext
from passes.fold_awq_scales import fold_awq_scales
from passes.quantize_int4 import quantize_int4
from passes.quantize_int8 import quantize_int8 as quantize_int8_pass
from runtime.format.engine_format import map_rank_file
from runtime.weights import int8


def plan_for(method: str, **quant):
    return exact_plan(method=method, **quant)


def float_graph(model_dir):
    model = load_model(str(model_dir))
    graph = trace(model)
    graph.tensors = {name: model.load(name) for name in graph.weights}
    return graph, model


@pytest.fixture(scope="module")
def outlier_llama_dir(tmp_path_factory):
    """The tiny Llama with three hidden channels whose norm weights are 25x: the outlier activations AWQ is for."""
    from transformers import LlamaForCausalLM

    path = make_tiny_llama(tmp_path_factory.mktemp("outlier_llama"), seed=3)
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[5, 17, 40]] *= 25
    model.save_pretrained(path)
    return path


# ------------------------------------------------------------------ rewrites on a small graph

def test_quantize_int4_rewrites_linears_and_keeps_excluded_nodes(tiny_llama_dir):
    graph, _ = float_graph(tiny_llama_dir)
    before = graph.format()
    out = quantize_int4(graph, PassContext(plan=plan_for("int4", group_size=32, exclude=["*lm_head*", "embed_tokens",
                                                                                         "layers.3.mlp.*"])))
    verify(out)
    assert graph.format() == before  # the input graph is untouched
    nodes = {n.name: n for n in out.nodes}
    q = nodes["layers.0.self_attn.q_proj"]
    assert q.op == "linear" and q.inputs[1:] == [f"{q.name}.{role}" for role in ("qweight", "scales", "zeros")]
    expected = {"quant": "int4", "group_size": 32, "layout": "logical", "operands": ["qweight", "scales", "zeros"],
                "in_features": 64, "out_features": 64}
    assert {k: q.attrs[k] for k in expected} == expected
    assert str(out.weights["layers.0.self_attn.q_proj.qweight"]) == "u8[64, 64]"
    assert str(out.weights["layers.0.self_attn.q_proj.zeros"]) == "f32[64, 2]"
    assert "layers.0.self_attn.q_proj.weight" not in out.weights  # the float weight is gone
    for name in ("embed_tokens", "lm_head", "layers.3.mlp.down_proj"):
        assert nodes[name].attrs["quant"] == "none"
    assert set(out.meta["quant_error"]) == {n.name for n in out.nodes if n.attrs.get("quant") == "int4"}


def test_tied_weights_are_quantized_and_packed_once(tiny_llama_tied_dir):
    graph, _ = float_graph(tiny_llama_tied_dir)
    out = quantize_int8_pass(graph, PassContext(plan=plan_for("int8", exclude=[])))
    embedding, logits = (next(n for n in out.nodes if n.op == op) for op in ("embedding", "logits"))
    assert embedding.inputs[1:] == logits.inputs[1:] == ["embed_tokens.qweight", "embed_tokens.scales"]
    packed = pack_graph(out)
    verify(packed)
    embedding, logits = (next(n for n in packed.nodes if n.op == op) for op in ("embedding", "logits"))
    assert embedding.inputs[1:] == logits.inputs[1:] and embedding.attrs["layout"] == "q8.p16k4"
    ids = list(range(3, 40))
    reference = GraphRunner(graph).run(ids)
    assert (GraphRunner(out).run(ids) - reference).abs().max() < 0.05 * reference.abs().max()


def test_fold_awq_scales_keeps_the_float_function_and_the_graph_size(outlier_llama_dir):
    graph, model = float_graph(outlier_llama_dir)
    folded = fold_awq_scales(graph, PassContext(plan=plan_for("int4-awq"), model=model))
    verify(folded)
    assert [n.name for n in folded.nodes] == [n.name for n in graph.nodes] and folded.weights == graph.weights
    norm = "layers.0.input_layernorm.weight"
    assert not torch.equal(folded.tensors[norm], graph.tensors[norm])  # scales went into the norm
    assert max(folded.meta["awq_alpha"].values()) > 0
    ids = list(range(3, 60))
    reference = GraphRunner(graph).run(ids)
    torch.testing.assert_close(GraphRunner(folded).run(ids), reference, atol=1e-4 * reference.abs().max(), rtol=0)


def test_int4_awq_has_lower_output_error_than_plain_int4(outlier_llama_dir, tmp_path):
    figures = {}
    for method in ("int4", "int4-awq"):
        result = build_engine(str(outlier_llama_dir), plan_for(method), tmp_path / method, show_progress=False)
        figures[method] = result.manifest["accuracy"]
    plain, awq = figures["int4"], figures["int4-awq"]
    assert awq["ppl_reference"] == plain["ppl_reference"]
    assert awq["kl_mean"] < 0.8 * plain["kl_mean"]
    assert awq["ppl_increase_pct"] < plain["ppl_increase_pct"]


def test_gptq_rounding_lowers_int4_awq_divergence(outlier_llama_dir, tmp_path):
    figures = {}
    for rounding in ("nearest", "gptq"):
        result = build_engine(str(outlier_llama_dir), plan_for("int4-awq", rounding=rounding), tmp_path / rounding,
                              show_progress=False)
        figures[rounding] = result.manifest["accuracy"]
    assert figures["gptq"]["kl_mean"] < 0.9 * figures["nearest"]["kl_mean"]


# ------------------------------------------------------------------ accuracy figures against transformers

def direct_figures(model_dir: Path, quantized_linears: bool) -> tuple[float, float, float]:
    """(ppl reference, ppl int8, mean KL) computed with transformers and torch over the evaluation windows."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in quantized.model.layers.modules():
            if isinstance(module, torch.nn.Linear) and quantized_linears:
                q, scales, _, _ = int8.quantize(module.weight)
                module.weight.copy_(int8.dequantize(q, scales))
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(shipped_text("evaluation"),
                                                                        add_special_tokens=False).ids
    nll_ref = nll_q = kl = count = 0.0
    for window in windows(ids, reference.config.max_position_embeddings):
        x = torch.tensor([window])
        with torch.inference_mode():
            log_p = torch.log_softmax(reference(x).logits[0, :-1].double(), -1)
            log_q = torch.log_softmax(quantized(x).logits[0, :-1].double(), -1)
        target = x[0, 1:, None]
        nll_ref -= float(log_p.gather(1, target).sum())
        nll_q -= float(log_q.gather(1, target).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        count += len(window) - 1
    return math.exp(nll_ref / count), math.exp(nll_q / count), kl / count


def test_accuracy_figures_equal_a_direct_transformers_computation(tiny_llama_dir, tmp_path):
    result = build_engine(str(tiny_llama_dir), plan_for("int8", max_ppl_increase=5.0), tmp_path / "e",
                          show_progress=False)
    accuracy = result.manifest["accuracy"]
    ppl_ref, ppl_q, kl = direct_figures(tiny_llama_dir, quantized_linears=True)
    assert accuracy["method"] == "int8" and accuracy["evaluation_tokens"] > 900
    assert accuracy["ppl_reference"] == pytest.approx(ppl_ref, rel=1e-5)
    assert accuracy["ppl_quantized"] == pytest.approx(ppl_q, rel=1e-5)
    assert accuracy["kl_mean"] == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert accuracy["ppl_increase_pct"] == pytest.approx(100 * (ppl_q / ppl_ref - 1), abs=1e-4)
    assert 0 < accuracy["layer_error_max"] < 0.02 and len(accuracy["layer_error"]) == 4 * 7
    report = (tmp_path / "e" / "report.md").read_text()
    assert "## Accuracy" in report and f"{accuracy['ppl_quantized']:.4f}" in report


def engine_build(*args):
    return subprocess.run([sys.executable, "-m", "builder.cli", "build", *map(str, args)], capture_output=True,
                          text=True)


def test_accuracy_gate_and_unknown_method_fail_with_one_line(tiny_llama_dir, tmp_path):
    proc = engine_build("--model", tiny_llama_dir, "--out", tmp_path / "gated", "--no-progress", "--quant", "int8",
                        "--activations", "f32", "--kv-dtype", "f32", "--max-ppl-increase", "0.001")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("engine-build: error: accuracy gate: int8 raised perplexity by ")
    assert "->" in lines[0] and "mean KL" in lines[0] and "above max_ppl_increase 0.001%" in lines[0]
    proc = engine_build("--model", tiny_llama_dir, "--out", tmp_path / "unknown", "--quant", "int3")
    assert proc.returncode != 0 and "[quant] method must be one of" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("method, quant, calibration, pattern", [
    ("int4", {"group_size": 128}, None, r"\[quant\] group_size 128 does not divide the input size 64 of "
                                        r"layers.0.self_attn.q_proj; use --group-size 32 or 64"),
    ("int4-awq", {}, "far too short", r"calibration text too short for int4-awq: \d+ tokens, at least 256 needed"),
    ("int4-awq", {"rounding": "fastest"}, None, r"\[quant\] rounding must be one of gptq, nearest, got 'fastest'"),
])
def test_bad_quantization_input_writes_nothing(tiny_llama_dir, tmp_path, method, quant, calibration, pattern):
    with pytest.raises(KilnError, match=pattern) as failure:
        build_engine(str(tiny_llama_dir), plan_for(method, **quant), tmp_path / "e", show_progress=False,
                     calibration_text=calibration)
    assert "\n" not in str(failure.value) and not (tmp_path / "e").exists()


# ------------------------------------------------------------------ KV cache in int8 / fp8

@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_uses_the_calibrated_scales(tiny_llama_dir, tmp_path, kv_dtype):
    from runtime.backends.cpu.executor import CpuExecutor
    from runtime.backends.step import StepMetadata

    plan = plan_for("none").with_overrides("kv_cache", dtype=kv_dtype)
    manifest = build_engine(str(tiny_llama_dir), plan, tmp_path / "e", show_progress=False).manifest
    rank = map_rank_file(tmp_path / "e" / "rank0.engine")
    scales = [n["attrs"]["kv_scale"] for n in json.loads(rank.program)["nodes"] if n["op"] == "attention"]
    assert len(scales) == 4 and all(0 < s < 1 for s in scales)
    assert manifest["accuracy"]["kv_cache_dtype"] == kv_dtype and manifest["accuracy"]["kl_mean"] > 0

    ids = list(range(5, 45))
    t = len(ids)
    meta = StepMetadata(token_ids=torch.tensor(ids), positions=torch.arange(t), slot_mapping=torch.arange(t),
                        block_tables=torch.arange(3, dtype=torch.int32)[None], context_lens=torch.tensor([t]).int(),
                        query_start_loc=torch.tensor([0, t]).int(), logits_indices=torch.arange(t))
    served = CpuExecutor(rank, pools=3, block_size=16, kv_dtype=kv_dtype).execute(meta)
    program, tensors = map_rank_file(tmp_path / "e" / "rank0.engine")
    float_logits = Interpreter(program, tensors, all_logits=True).logits(ids)
    graph, _ = float_graph(tiny_llama_dir)
    for node, scale in zip([n for n in graph.nodes if n.op == "attention"], scales):
        node.attrs["kv_scale"] = scale
    emulated = GraphRunner(graph, kv_dtype).run(ids)
    torch.testing.assert_close(served, emulated, atol=1e-4, rtol=0)  # the C cache rounds as the emulation does
    assert 0 < (served - float_logits).abs().max() < 0.1 * float_logits.abs().max()


# ------------------------------------------------------------------ the embedded GGUF: method "source"

def test_source_method_keeps_the_gguf_blocks_and_matches_transformers(smollm2_exact_engine, smollm2_gguf):
    from builder.verify import load_transformers_model

    manifest = json.loads((smollm2_exact_engine / "manifest.json").read_text())
    assert manifest["quantization"]["nodes"] == {"int4 g32": 120, "int8 g32": 2}  # fused q/k/v and gate/up
    assert manifest["accuracy"]["method"] == "source" and manifest["accuracy"]["evaluated"] is False
    program, tensors = map_rank_file(smollm2_exact_engine / "rank0.engine")
    nodes = json.loads(program)["nodes"]
    embedding, logits = (next(n for n in nodes if n["op"] == op) for op in ("embedding", "logits"))
    assert embedding["inputs"][1:] == logits["inputs"][1:] and logits["attrs"]["quant"] == "int8"
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < 100e6  # float32 would be 540 MB
    ids = [1, 504, 3458, 282, 4649, 314, 216, 28, 253, 1789]
    with torch.inference_mode():
        expected = load_transformers_model(str(smollm2_gguf))(torch.tensor([ids])).logits[0]
    ours = Interpreter(program, tensors, all_logits=True).logits(ids)
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
