"""Numerical parity of the tensorrt target's ONNX, one operator family at a time.

Each build lowers a tiny Llama with 6 query / 3 KV heads (uneven over TP=2) and tied embeddings into per-rank ONNX and
runs it under ONNX Runtime, stitched across both ranks, against Kiln's cpu engine of the same
quantized program on prefill, decode and mixed steps over scattered, partly filled KV blocks. The
families: float linears, INT8 per-channel and FP8 weight DequantizeLinear, INT4 zero-point grids as
a symmetric block DequantizeLinear plus the group-sum correction; attention in all three step kinds. And the
onnxruntime backend's sessions dequantize no weight on every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from builder.build import build_engine
from builder.planning.plan import load_plan

PLANS = Path(__file__).resolve().parents[2] / "plans"
# f32 activations and an f32 KV cache: the same math in another order (an f16 cache adds its
# rounding boundaries, covered by the build's own tolerance in test_tensorrt.py)
F32_LIMIT = 1e-4

# quant method -> (device that has it, the weight DequantizeLinear the lowering must emit: (input
# element type, block_size attribute, or None for per-channel), or None for a float model)
FAMILIES = {
    "none": ("nvidia-a100-80gb", None),
    "int8": ("nvidia-a100-80gb", (onnx.TensorProto.INT8, None)),
    "int4": ("nvidia-a100-80gb", (onnx.TensorProto.INT4, 32)),
    "fp8": ("nvidia-l40s", (onnx.TensorProto.FLOAT8E4M3FN, None)),
}


def weight_dequantizers(rank_dir: Path) -> set[tuple[int, int | None]]:
    """(weight element type, block_size) of every DequantizeLinear that reads an initializer."""
    found = set()
    for path in sorted(rank_dir.glob("segment*.onnx")):
        model = onnx.load(path, load_external_data=False)
        types = {init.name: init.data_type for init in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "DequantizeLinear" and node.input[0] in types:
                block = next((a.i for a in node.attribute if a.name == "block_size" and a.i), None)
                found.add((types[node.input[0]], block))
    return found


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_llama_tied_dir, tmp_path_factory):
    method = request.param
    device, dequantize = FAMILIES[method]
    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides(device=device, tp=2)
    plan = plan.with_overrides("quant", method=method, activations="f32").with_overrides("kv_cache", dtype="f32")
    out = tmp_path_factory.mktemp("parity") / method
    build_engine(str(tiny_llama_tied_dir), plan, out, show_progress=False, onnx_only=True)
    return method, dequantize, out


def test_every_step_kind_matches_the_cpu_engine(family):
    method, _, engine = family
    verification = json.loads((engine / "manifest.json").read_text())["verification"]
    kinds = [step["step"] for step in verification["steps"]]
    assert {"prefill", "decode", "mixed"} <= set(kinds), kinds
    for step in verification["steps"]:
        assert step["max_abs_logit_diff"] <= F32_LIMIT, (method, step)
    # fp8 plans round activations to e4m3 (Q/DQ), whose flips cascade on real models: the build allows a share
    # of the largest logit; on this model they stay within F32_LIMIT all the same
    limit = 0.25 * verification["max_abs_logit"] if method == "fp8" else 1e-3
    assert verification["top1_agreement"] == 1.0 and verification["tolerance"] == pytest.approx(limit, rel=1e-4)
    assert verification["max_abs_logit"] > 0.1  # the logits were compared, not zeros


def test_the_weights_take_the_form_tensorrt_wants(family):
    method, dequantize, engine = family
    manifest = json.loads((engine / "manifest.json").read_text())
    forms = set().union(*(weight_dequantizers(engine / rank["onnx"]["dir"]) for rank in manifest["ranks"]))
    if dequantize is None:
        assert forms == set(), forms
    else:
        assert dequantize in forms, (method, forms)
        # no other weight quantization slipped in (the embedding is dequantized to a float table)
        assert forms == {dequantize}, (method, forms)


def test_onnx_runtime_dequantizes_the_weights_once_at_load(family, tmp_path):
    """No weight DequantizeLinear is left to run on every step: ONNX Runtime folds int8 and fp8 ones into float
    weights at load, and takes the block-INT4 ones into its n-bit kernel, which keeps them 4-bit."""
    import onnxruntime

    from runtime.backends.onnxruntime.executor import session_options

    method, _, engine = family
    ops, weight_dequantizers = set(), []
    for path in sorted((engine / "onnx" / "rank0").glob("segment*.onnx")):
        options = session_options(onnxruntime, path, 1)
        options.optimized_model_filepath = str(tmp_path / path.name)  # the graph ONNX Runtime runs
        onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(tmp_path / path.name, load_external_data=False).graph
        weights = {init.name for init in graph.initializer}
        ops |= {node.op_type for node in graph.node}
        weight_dequantizers += [node.name for node in graph.node
                                if node.op_type == "DequantizeLinear" and node.input[0] in weights]
    assert weight_dequantizers == [] and "MatMul" in ops, (method, weight_dequantizers)
    assert ("MatMulNBits" in ops) == (method == "int4"), method


def test_sliding_window_attention_matches_the_cpu_engine(tiny_mistral_dir, tmp_path):
    # Windows of 8 positions; the verification's prompts (up to 2 blocks + 1) and decodes run past them,
    # so an ONNX body that ignored the window would differ from the cpu engine by whole logits.
    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides(tp=2)
    plan = plan.with_overrides("quant", method="none", activations="f32").with_overrides("kv_cache", dtype="f32")
    build_engine(str(tiny_mistral_dir), plan, tmp_path / "e", show_progress=False, onnx_only=True)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    for step in manifest["verification"]["steps"]:
        assert step["max_abs_logit_diff"] <= F32_LIMIT, step
    assert manifest["verification"]["top1_agreement"] == 1.0
    windows = set()
    for path in sorted((tmp_path / "e" / manifest["ranks"][0]["onnx"]["dir"]).glob("segment*.onnx")):
        for node in onnx.load(path, load_external_data=False).graph.node:
            if node.op_type == "PagedAttention":
                windows.update(a.i for a in node.attribute if a.name == "window")
    assert windows == {8}


def test_gemma3_operators_match_the_cpu_engine(tiny_gemma3_dir, tmp_path):
    # q/k head norms, GeGLU, scaled embeddings, sandwich norms and per-layer windows and rope bases, on
    # two tensor-parallel ranks.
    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides(tp=2)
    plan = plan.with_overrides("quant", method="none", activations="f32").with_overrides("kv_cache", dtype="f32")
    build_engine(str(tiny_gemma3_dir), plan, tmp_path / "e", show_progress=False, onnx_only=True)
    verification = json.loads((tmp_path / "e" / "manifest.json").read_text())["verification"]
    for step in verification["steps"]:
        assert step["max_abs_logit_diff"] <= F32_LIMIT, step
    assert verification["top1_agreement"] == 1.0 and verification["max_abs_logit"] > 0.1


def test_an_fp8_cache_matches_the_cpu_engines_fp8_cache(tiny_llama_tied_dir, tmp_path):
    """The pools hold e4m3 codes as int8 (ONNX has no float8 scatter): ONNX Runtime's body must store and read
    what the cpu engine's fp8 cache does, over both ranks and every step kind. An encoding off by one code moves
    a key by an eighth of its value and the logits far outside the build's tolerance."""
    plan = load_plan(PLANS / "l40s-fp8.toml").with_overrides(tp=2)
    plan = plan.with_overrides("quant", method="none", activations="f32").with_overrides("kv_cache", dtype="fp8")
    build_engine(str(tiny_llama_tied_dir), plan, tmp_path / "e", show_progress=False, onnx_only=True)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    verification = manifest["verification"]
    assert {"prefill", "decode", "mixed"} <= {step["step"] for step in verification["steps"]}
    assert verification["top1_agreement"] == 1.0 and verification["max_abs_logit"] > 0.1
    assert verification["max_abs_logit_diff"] <= verification["tolerance"]
    assert verification["max_abs_logit_diff"] <= 1e-3 * verification["max_abs_logit"]
    for rank in manifest["ranks"]:
        for path in sorted((tmp_path / "e" / rank["onnx"]["dir"]).glob("segment*.onnx")):
            graph = onnx.load(path, load_external_data=False).graph
            pools = [i for i in graph.input if i.name.startswith("kv.")]
            assert all(p.type.tensor_type.elem_type == onnx.TensorProto.INT8 for p in pools)
