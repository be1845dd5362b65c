"""The tensorrt target on a CPU-only machine: per-rank ONNX verified against the cpu engine, real
TensorRT-RTX engines compiled ahead of time, the onnxruntime backend generating and serving the same
greedy text as the cpu engine (TP=1, TP=2, PP=2 in real rank processes), and every bad input refused
in one line. Running the TensorRT engines themselves needs a GPU: no test here pretends to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from builder.build import build_engine
from builder.errors import KilnError
from builder.planning.plan import load_plan
from runtime.core.engine import EngineOptions
from runtime.format.engine_format import map_rank_file
from runtime.launcher import open_llm_engine
from runtime.core.sampling import SamplingParams
from test_build import assert_one_line_error, engine_build
from test_server import ServerProcess

PLANS = Path(__file__).resolve().parents[2] / "plans"
PROMPTS = ["The quick brown fox", "Kiln bakes a language model"]

try:
    import tensorrt_rtx_bindings  # noqa: F401

    HAS_TENSORRT = True
except ImportError:
    HAS_TENSORRT = False
needs_tensorrt = pytest.mark.skipif(not HAS_TENSORRT, reason="TensorRT-RTX is not installed "
                                                             "(pip install -e \".[tensorrt]\")")


def tensorrt_plan(tp=1, pp=1, activations="f32"):
    """The A100 INT4 plan with the test's parallelism and activations."""
    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides(tp=tp, pp=pp)
    return plan.with_overrides("quant", activations=activations)


def cpu_twin(plan):
    """The cpu target's plan of the same quantization and KV cache, computing in f32."""
    doc = plan.to_dict()
    doc.update(target="cpu", device="cpu", tp=1, pp=1)
    doc["quant"]["activations"] = "f32"
    doc["kv_cache"]["memory_fraction"] = 0.5
    from builder.planning.plan import plan_from_dict

    return plan_from_dict(doc, "cpu twin")


def greedy(engine: Path, backend: str | None, max_tokens: int = 16) -> list[list[int]]:
    options = EngineOptions(backend=backend, kv_cache_gib=0.02, num_threads=1)
    with open_llm_engine(engine, options) as llm:
        ids = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for p in PROMPTS]
        done = {}
        while len(done) < len(ids):
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return [done[i] for i in ids]


@pytest.fixture(scope="module")
def built(tiny_llama_dir, tmp_path_factory):
    """(tp, pp, activations, onnx_only) -> engine directory, built once each."""
    cache = {}

    def build(tp=1, pp=1, activations="f32", onnx_only=True):
        key = (tp, pp, activations, onnx_only)
        if key not in cache:
            out = tmp_path_factory.mktemp("trt") / f"tp{tp}pp{pp}{activations}{'onnx' if onnx_only else 'trt'}"
            build_engine(str(tiny_llama_dir), tensorrt_plan(tp, pp, activations), out, show_progress=False,
                         onnx_only=onnx_only)
            cache[key] = out
        return cache[key]

    return build


@pytest.fixture(scope="module")
def cpu_twin_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "cpu-twin"
    build_engine(str(tiny_llama_dir), cpu_twin(tensorrt_plan()), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def cpu_tokens(cpu_twin_dir):
    return greedy(cpu_twin_dir, None)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_onnxruntime_backend_generates_the_cpu_engines_greedy_text(built, cpu_tokens, tp, pp):
    engine = built(tp, pp, onnx_only=(tp, pp) != (2, 1) or not HAS_TENSORRT)
    import json

    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["verification"]["max_abs_logit_diff"] <= 1e-3
    assert [s["step"] for s in manifest["verification"]["steps"]] == ["prefill", "decode", "mixed", "decode"]
    assert len(manifest["ranks"]) == tp * pp
    assert greedy(engine, "onnxruntime") == cpu_tokens


def test_f16_activations_stay_within_the_recorded_tolerance(built):
    import json

    engine = built(activations="f16")
    verification = json.loads((engine / "manifest.json").read_text())["verification"]
    assert 0 < verification["max_abs_logit_diff"] <= verification["tolerance"]
    assert verification["top1_agreement"] >= 0.9
    assert all(len(tokens) == 16 for tokens in greedy(engine, "onnxruntime"))


@needs_tensorrt
def test_a_real_tensorrt_build_writes_one_engine_a_rank_with_the_plugin_and_pools_in_place(built):
    import json

    engine = built(2, 1, onnx_only=False)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["target"]["requires"]["compute_capability"] == "8.0"
    assert manifest["target"]["tensorrt"]["flavour"] == "tensorrt-rtx"
    trt = manifest["tensorrt"]
    assert trt["compiled"] and len(trt["build_seconds"]) == 2 and trt["engines_per_rank"] == 1
    plugin = trt["plugins"][0]
    assert (plugin["name"], plugin["namespace"], plugin["registered"]) == ("PagedAttention", "kiln", True)
    assert (engine / plugin["library"]).is_file() and trt["kernels"]["arch"] == "sm_80"
    # the plugin's three kernels (the same for every layer here), no sampler on a two-rank engine
    assert trt["kernels"]["kernels"] == 3 and len(list((engine / "kernels").glob("*.cubin"))) == 3
    for rank in manifest["ranks"]:
        program, tensors = map_rank_file(engine / rank["file"])
        steps = json.loads(program)["steps"]
        assert list(tensors) == ["engine"] and [s.get("engine") for s in steps] == ["engine"]
        assert tensors["engine"].numel() > 10_000  # a serialized TensorRT plan, not a placeholder
        e = rank["engine"]
        # every collective inside the one engine: two all_reduces a layer, the embedding's, the logits' gather
        assert e["collectives"] == len(rank["io"]["exchanges"]) == 2 * 4 + 2
        assert e["plugin_layers"] == 4
        assert 0 < e["activation_bytes"] <= e["workspace_bytes"]
        assert e["io"]["aliases"] == {f"kv.{layer}.{kind}.out": f"kv.{layer}.{kind}" for layer in range(4)
                                      for kind in "kv"}
        assert set(rank["onnx"]["files"]) >= {"program.json", "weights.bin", "segment00.onnx"}


@needs_tensorrt
def test_smollm2_builds_one_engine_a_rank_within_its_memory_plan(tmp_path):
    """The real model at the size CI affords: SmolLM2-135M at tp=2 for sm_80, its GGUF blocks kept exactly with an
    f32 cache (so no accuracy measure runs), f16 activations. Each rank is one engine whose 30 attention layers are
    the plugin, with every pool output aliasing its input, and whose 62 collectives are inside it; TensorRT's
    activation memory is within the rank's memory plan, which prices the rank's KV blocks with it."""
    import json

    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides("quant", method="source")
    build_engine("smollm2-135m", plan.with_overrides("kv_cache", dtype="f32"), tmp_path / "e", show_progress=False)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    trt = manifest["tensorrt"]
    assert trt["engines_per_rank"] == 1 and trt["plugins"][0]["registered"] and trt["kernels"]["arch"] == "sm_80"
    assert manifest["accuracy"]["evaluated"] is False  # the GGUF's blocks kept: nothing to measure
    for rank, memory in zip(manifest["ranks"], manifest["memory"]["ranks"]):
        e = rank["engine"]
        assert (e["plugin_layers"], e["collectives"]) == (30, 2 * 30 + 2)
        assert e["io"]["aliases"] == {f"kv.{layer}.{kind}.out": f"kv.{layer}.{kind}" for layer in range(30)
                                      for kind in "kv"}
        assert 0 < e["activation_bytes"] <= e["workspace_bytes"] == memory["workspace_bytes"]
        assert memory["kv_blocks"] > 0
    assert manifest["verification"]["max_abs_logit_diff"] <= manifest["verification"]["tolerance"]


@needs_tensorrt
def test_the_executor_binds_each_pool_and_its_output_to_one_buffer(built):
    """pool_bindings is what the tensorrt executor binds (runtime/backends/tensorrt/executor.py), here over a real
    engine's I/O and pools of every planned block: an output pool that got its own buffer would fail this."""
    import json

    from runtime.format.engine_format import EngineError
    from runtime.backends.cpu.executor import KVCacheStorage
    from runtime.format.kv_groups import KVGroups
    from runtime.backends.tensorrt.executor import pool_bindings, pool_layers

    engine = built(2, 1, onnx_only=False)
    manifest = json.loads((engine / "manifest.json").read_text())
    io = json.loads(map_rank_file(engine / manifest["ranks"][0]["file"])[0])["steps"][0]
    shapes = {n: (-1, 16, 1, 16) for n in io["inputs"] if n.startswith("kv.")}  # 2 KV heads of 16, over tp=2
    blocks = 37
    cache = KVCacheStorage(pool_layers(io, shapes), KVGroups((0,), (blocks,)), 16, "f16")
    bound = pool_bindings(io, cache)
    pools = [n for n in io["inputs"] if n.startswith("kv.")]
    assert len(pools) == 8 and all(bound[n].shape[0] == blocks for n in pools)  # every planned block, not half
    for name in pools:
        assert bound[f"{name}.out"].data_ptr() == bound[name].data_ptr()
    assert len({bound[n].data_ptr() for n in pools}) == len(pools)  # and no two layers share one
    broken = dict(io, aliases={k: v for k, v in io["aliases"].items() if k != "kv.2.v.out"})
    with pytest.raises(EngineError, match="kv.2.v.out does not alias"):
        pool_bindings(broken, cache)


@needs_tensorrt
@pytest.mark.parametrize("device,arch", [("nvidia-a10", "sm_86"), ("nvidia-l4", "sm_89"),
                                         ("nvidia-rtx-5090", "sm_120")])
def test_engines_build_for_each_rtx_compute_capability(tiny_llama_dir, tmp_path, device, arch):
    import json

    out = tmp_path / "e"
    plan = tensorrt_plan(activations="f16").with_overrides(device=device)
    build_engine(str(tiny_llama_dir), plan, out, show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tensorrt"]["kernels"]["arch"] == arch and manifest["tensorrt"]["plugins"][0]["registered"]
    # one rank: the plugin's three kernels and the device sampler's (greedy, grammar mask, log-probs)
    assert manifest["tensorrt"]["kernels"]["kernels"] == 6
    e = manifest["ranks"][0]["engine"]
    assert e["plugin_layers"] == 4 and e["collectives"] == 0 and 0 < e["activation_bytes"] <= e["workspace_bytes"]


@needs_tensorrt
def test_fp8_plans_quantize_activations_for_fp8_gemms_and_measure_it(tiny_llama_dir, tmp_path):
    """An fp8 plan puts Q/DQ with a calibrated scale on every fp8 linear's input; the cpu engine rounds the same
    inputs the same way, so with f32 activations ONNX Runtime matches it as closely as without fp8."""
    import json

    import onnx

    out = tmp_path / "fp8"
    plan = load_plan(PLANS / "l40s-fp8.toml").with_overrides(device="nvidia-l4")
    build_engine(str(tiny_llama_dir), plan.with_overrides("quant", activations="f32"), out, show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "calibrate_fp8_activations" in [p["name"] for p in manifest["passes"]]
    assert manifest["verification"]["max_abs_logit_diff"] <= 1e-4
    nodes = [n for path in sorted((out / "onnx" / "rank0").glob("segment*.onnx"))
             for n in onnx.load(str(path), load_external_data=False).graph.node]
    quantized = [n for n in nodes if n.op_type == "QuantizeLinear"]
    # the four layers' qkv, o, gate_up and down projections (the embedding and lm_head are excluded)
    assert len(quantized) == 4 * 4 and all(n.input[2].endswith(".act_zero") for n in quantized)
    e = manifest["ranks"][0]["engine"]
    assert e["plugin_layers"] == 4 and e["activation_bytes"] <= e["workspace_bytes"]
    # the plan's fp8 KV cache: int8 pools of e4m3 codes, bound in place, and the plugin's fp8 kernels
    assert manifest["plan"]["kv_cache"]["dtype"] == "fp8" and len(e["io"]["aliases"]) == 8
    pools = [i for path in sorted((out / "onnx" / "rank0").glob("segment*.onnx"))
             for i in onnx.load(str(path), load_external_data=False).graph.input if i.name.startswith("kv.")]
    assert len(pools) == 8 and all(p.type.tensor_type.elem_type == onnx.TensorProto.INT8 for p in pools)
    index = json.loads((out / "kernels" / "index.json").read_text())
    assert "fp8e4nv" in json.dumps(index)


def test_serve_with_the_onnxruntime_backend(built, cpu_tokens, tmp_path):
    server = ServerProcess(built(2, 1, onnx_only=not HAS_TENSORRT), tmp_path / "serve.log", "--backend", "onnxruntime")
    try:
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0],
                                                                  "max_tokens": 16, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == len(cpu_tokens[0])
    finally:
        assert server.stop() == 0


def test_a_tensorrt_engine_and_a_cpu_engine_share_one_endpoint(built, cpu_twin_dir, cpu_tokens, tmp_path):
    """A fleet of two targets: the tensorrt engine (its verified ONNX, run by the onnxruntime backend the fleet
    file names for it) and its cpu twin, each answering under its own name with the cpu engine's greedy text."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[[models]]\nname = "trt"\nengine = "{built()}"\nbackend = "onnxruntime"\n\n'
                     f'[[models]]\nname = "cpu"\nengine = "{cpu_twin_dir}"\n')
    server = ServerProcess(None, tmp_path / "fleet.log", "--fleet", str(fleet))
    try:
        for model in ("trt", "cpu"):
            reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
            assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
            assert reply.json()["usage"]["completion_tokens"] == len(cpu_tokens[0])
        texts = {m: httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": m, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}).json()["choices"][0]["text"]
            for m in ("trt", "cpu")}
        assert texts["trt"] == texts["cpu"]
    finally:
        assert server.stop() == 0, server.log()


# ---------------------------------------------------------------------------------------- bad input

def test_a_gpu_no_installed_tensorrt_targets_stops_before_any_work(tiny_llama_dir, tmp_path):
    out = tmp_path / "h100"
    proc = engine_build("build", "--model", tiny_llama_dir, "--plan", PLANS / "h100-tp4-fp8.toml", "--out", out,
                        "--no-progress")
    assert_one_line_error(proc, r"compute capability 9\.0 cannot be compiled here .*--onnx-only")
    assert not out.exists()


def test_onnx_only_applies_to_tensorrt_plans(tiny_llama_dir, tmp_path):
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", tmp_path / "e", "--onnx-only")
    assert_one_line_error(proc, r"--onnx-only: the cpu target writes no ONNX")


def run(*args):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *map(str, args)], capture_output=True, text=True)


def assert_run_error(proc, pattern):
    import re

    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("engine-run: error: ") and re.search(pattern, lines[0]), lines[0]


def test_a_tensorrt_engine_without_a_gpu_names_the_onnxruntime_backend(built):
    engine = built()
    assert_run_error(run("generate", engine, "-p", "hi"), r"--backend onnxruntime")
    assert_run_error(run("generate", engine, "-p", "hi", "--backend", "tensorrt"),
                     r"built with --onnx-only.*engine-build compile")
    assert_run_error(run("generate", engine, "-p", "hi", "--backend", "cpu"),
                     r"runs with --backend onnxruntime or tensorrt")


def test_a_tampered_onnx_file_is_refused(built, tmp_path):
    import shutil

    engine = tmp_path / "copy"
    shutil.copytree(built(), engine)
    weights = engine / "onnx" / "rank0" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_run_error(run("generate", engine, "-p", "hi", "--backend", "onnxruntime"),
                     r"weights\.bin: sha256 does not match")


def test_lint_rejects_an_op_the_parser_lacks(tiny_llama_dir):
    import onnx

    from builder.targets.tensorrt.onnx_lint import lint_model, load_op_table

    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("DFT", ["x"], ["y"], name="spectrum")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]),
        opset_imports=[onnx.helper.make_opsetid("", 21)])
    problems = lint_model(model, load_op_table("tensorrt-rtx", "1.7.1.116"))
    assert problems and "spectrum" in problems[0] and "DFT" in problems[0]


def test_a_failing_verification_writes_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    import builder.targets.tensorrt.build as target

    monkeypatch.setattr(target, "F32_TOLERANCE", 0.0)  # any difference at all now fails the build
    monkeypatch.setattr(target, "HALF_KV_TOLERANCE", 0.0)
    out = tmp_path / "e"
    with pytest.raises(KilnError, match="differ from the cpu engine"):
        build_engine(str(tiny_llama_dir), tensorrt_plan(), out, show_progress=False, onnx_only=True)
    assert not out.exists() and not list(tmp_path.iterdir())


@needs_tensorrt
def test_compile_finishes_an_onnx_only_build(built, tmp_path):
    import json
    import shutil

    engine = tmp_path / "later"
    shutil.copytree(built(), engine)
    proc = engine_build("compile", engine)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["tensorrt"]["compiled"] and manifest["target"]["tensorrt"]["flavour"] == "tensorrt-rtx"
    assert (engine / manifest["ranks"][0]["file"]).is_file() and not (engine / ".compile").exists()
    assert_one_line_error(engine_build("compile", engine), r"compiled already")
    assert greedy(engine, "onnxruntime")  # the ONNX it was compiled from still runs and verifies
