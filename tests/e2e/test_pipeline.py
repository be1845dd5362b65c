"""The pipeline built from the plan: which passes run for which plan, with which parameters, and
the manifest listing exactly those."""

import json

import pytest
from conftest import canonical_graph, exact_plan

from builder.build import build_engine
from builder.pipeline import build_pipeline
from builder.planning.plan import Plan, load_plan
from passes.calibrate_kv_scales import calibrate_kv_scales
from passes.clip_awq_weights import clip_awq_weights
from passes.context import PassContext
from passes.fold_awq_scales import fold_awq_scales
from passes.keep_source_quant import keep_source_quant
from passes.measure_accuracy import measure_accuracy
from passes.pack_weights import pack_weights
from passes.quantize_fp8 import quantize_fp8
from passes.quantize_int4 import quantize_int4
from passes.quantize_int4_gptq import quantize_int4_gptq
from passes.quantize_int8 import quantize_int8

# The passes a plan can leave out: build_pipeline alone decides whether they run.
OPTIONAL = {p.__name__: p for p in (keep_source_quant, calibrate_kv_scales, fold_awq_scales, clip_awq_weights,
                                    quantize_int8, quantize_int4_gptq, quantize_int4, quantize_fp8,
                                    measure_accuracy, pack_weights)}
ALWAYS = ["canonicalize", "fuse_qkv", "fuse_gate_up", "fuse_add_rms_norm", "split_pipeline_stages",
          "shard_tensor_parallel", "plan_memory"]

PLANS = {  # name -> (quant overrides, kv dtype, the optional passes that run)
    "none": ({"method": "none"}, "f32", ["pack_weights"]),
    "none-f16": ({"method": "none"}, "f16", ["measure_accuracy", "pack_weights"]),  # an f16 cache rounds K, V
    "none-kv-int8": ({"method": "none"}, "int8", ["calibrate_kv_scales", "measure_accuracy", "pack_weights"]),
    "source": ({"method": "source"}, "f32", ["keep_source_quant", "measure_accuracy", "pack_weights"]),
    "int8": ({"method": "int8"}, "f32", ["keep_source_quant", "quantize_int8", "measure_accuracy", "pack_weights"]),
    "int4": ({"method": "int4"}, "f32", ["keep_source_quant", "quantize_int4", "measure_accuracy", "pack_weights"]),
    "int4-awq": ({"method": "int4-awq"}, "f32", ["keep_source_quant", "fold_awq_scales", "quantize_int4_gptq",
                                                 "quantize_int4", "measure_accuracy", "pack_weights"]),
    "int4-awq-nearest": ({"method": "int4-awq", "rounding": "nearest"}, "fp8",
                         ["keep_source_quant", "calibrate_kv_scales", "fold_awq_scales", "clip_awq_weights",
                          "quantize_int4", "measure_accuracy", "pack_weights"]),
    "fp8": ({"method": "fp8"}, "f32", ["keep_source_quant", "quantize_fp8", "measure_accuracy", "pack_weights"]),
}


def plan_named(name: str) -> Plan:
    quant, kv_dtype, _ = PLANS[name]
    return exact_plan(**quant).with_overrides("kv_cache", dtype=kv_dtype)


@pytest.mark.parametrize("name", PLANS)
def test_the_plan_chooses_the_passes_in_pipeline_order(name):
    names = [p.name for p in build_pipeline(plan_named(name))]
    assert [n for n in names if n not in ALWAYS] == PLANS[name][2]
    assert [n for n in names if n in ALWAYS] == ALWAYS
    assert names.index("fuse_add_rms_norm") < names.index("split_pipeline_stages") < names.index("pack_weights")


def test_each_pass_carries_what_it_depends_on():
    passes = {p.name: p for p in build_pipeline(plan_named("int4-awq"), calibration_text="some text")}
    calibration = passes["fold_awq_scales"].params["calibration_sha256"]
    assert passes["quantize_int4_gptq"].params == {"method": "int4-awq", "group_size": 32,
                                                   "exclude": ["*lm_head*", "embed_tokens"], "rounding": "gptq",
                                                   "calibration_sha256": calibration}
    assert passes["quantize_int4"].params == {"method": "int4-awq", "group_size": 32,
                                              "exclude": ["*lm_head*", "embed_tokens"]}
    assert passes["canonicalize"].params == {} and passes["split_pipeline_stages"].params == {"tp": 1, "pp": 1}
    other = {p.name: p for p in build_pipeline(plan_named("int4-awq"), calibration_text="other text")}
    assert other["fold_awq_scales"].params["calibration_sha256"] != calibration
    assert [p.name for p in build_pipeline(plan_named("int4-awq"))] == list(passes)
    assert [p.per_rank for p in passes.values()][-4:] == [True] * 4 and not passes["measure_accuracy"].per_rank


@pytest.fixture(scope="module")
def canonical(tiny_llama_dir):
    return canonical_graph(tiny_llama_dir)


@pytest.mark.parametrize("name", ["int8", "int4", "int4-awq", "int4-awq-nearest", "fp8", "none-kv-int8"])
def test_a_pass_the_plan_runs_changes_the_graph(canonical, name):
    """Every rewriting pass the plan lists changes its input. Not checked: keep_source_quant (a Hugging
    Face checkpoint has no GGUF blocks to keep), quantize_int4 after quantize_int4_gptq (it rounds
    what GPTQ left: a weight two linears share, nothing in a llama), pack_weights of a float build
    (the cpu target's pass; it packs what is quantized) and measure_accuracy (an analysis: the build
    tests read its figures)."""
    graph, model = canonical
    plan = plan_named(name)
    ctx = PassContext(plan=plan, model=model)
    names = [step.name for step in build_pipeline(plan)]
    for step in build_pipeline(plan):
        if step.name == "measure_accuracy":
            continue
        after = step.run(graph, ctx)
        unchecked = ["keep_source_quant", "quantize_int4" if "quantize_int4_gptq" in names else "",
                     "pack_weights" if plan.quant.method == "none" else ""]
        if step.name in OPTIONAL and step.name not in unchecked:
            changed = after is not graph and (
                after.nodes != graph.nodes or after.weights != graph.weights
                or any(not after.tensors[w].equal(graph.tensors[w]) for w in graph.weights if w in after.weights))
            assert changed, f"{step.name} left the graph as it was"
        graph = after


def test_manifests_list_exactly_the_passes_that_ran(tiny_llama_dir, tmp_path):
    manifests = {}
    for name in ("none", "int8", "source"):
        plan = plan_named(name)
        result = build_engine(str(tiny_llama_dir), plan, tmp_path / name, show_progress=False)
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["passes"] == result.manifest["passes"] == [p.record() for p in build_pipeline(plan)]
        manifests[name] = [p["name"] for p in manifest["passes"]]
    assert manifests["none"] != manifests["int8"] != manifests["source"]
    assert "quantize_int8" in manifests["int8"] and "quantize_int8" not in manifests["source"]
    assert "keep_source_quant" in manifests["source"] and "quantize_int4" not in manifests["source"]
    assert "keep_source_quant" not in manifests["none"] and "measure_accuracy" not in manifests["none"]


def test_the_default_plan_file_holds_the_plan_defaults():
    assert load_plan() == Plan()
