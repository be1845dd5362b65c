"""The cuda target and backend without a GPU: plans for sm_80, sm_89 and sm_90a build with cubins in the engine,
byte for byte again; `engine-build verify` passes; and the backend itself (device pools, decode graphs, the
scheduler around it) serves a tiny model through Triton's interpreter with the cpu engine's greedy tokens.

What needs a GPU (the cubins launched, CUDA graphs captured, NCCL) is benchmarks/gpu_check.py's work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import exact_plan

from builder.build import build_engine
from builder.planning.plan import plan_from_dict
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import EngineError, Manifest
from runtime.backends import check_files
from runtime.core.constraints import regex_grammar
from runtime.core.sampling import SamplingParams

ARCHES = {"nvidia-a100-80gb": "sm_80", "nvidia-l40s": "sm_89", "nvidia-h100-80gb": "sm_90a"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [4, 8, 15, 16, 23, 42]]


def cuda_plan(device="nvidia-h100-80gb", **quant):
    return plan_from_dict({"target": "cuda", "device": device,
                           "limits": {"max_batch_size": 4, "max_num_tokens": 16, "max_seq_len": 64},
                           "kv_cache": {"dtype": quant.pop("kv_dtype", "f32")},
                           "quant": {"method": "none", "activations": "f32", **quant}}, "test")


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    built = {}
    for device in ARCHES:
        built[device] = build_engine(str(tiny_llama_dir), cuda_plan(device), root / device, show_progress=False)
    built["cpu"] = build_engine(str(tiny_llama_dir), exact_plan(method="none"), root / "cpu", show_progress=False)
    return built


def test_each_arch_gets_cubins_in_the_engine_hashed_and_rebuilt_byte_for_byte(engines, tiny_llama_dir, tmp_path):
    for device, arch in ARCHES.items():
        result = engines[device]
        section = result.manifest["cuda"]
        assert section["arch"] == arch and section["kernels"] >= 6, section
        assert result.manifest["target"] == {"name": "cuda", "requires": {
            "gpu_arch": arch, "compute_capability": section["compute_capability"]}}
        cubins = sorted((result.out / "kernels").glob("*.cubin"))
        assert len(cubins) == section["kernels"]
        assert all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)  # what the driver loads: ELF cubins
        check_files(result.out, Manifest.read(result.out))  # every file the manifest lists, by sha256, cubins too
    again = build_engine(str(tiny_llama_dir), cuda_plan(), tmp_path / "again", show_progress=False)
    first = engines["nvidia-h100-80gb"].out
    names = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(again.out) for p in again.out.rglob("*") if p.is_file())
    assert all((first / n).read_bytes() == (again.out / n).read_bytes() for n in names)


def test_a_changed_cubin_is_refused(engines, tmp_path):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engines["nvidia-h100-80gb"].out, copy)
    cubin = next((copy / "kernels").glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="sha256 does not match"):
        check_files(copy, Manifest.read(copy), "cuda")


def test_verify_exits_0_on_a_cuda_engine(engines, tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "builder.cli", "verify", str(engines["nvidia-h100-80gb"].out),
                           "--model", str(tiny_llama_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every variant the program launches among them" in done.stdout
    assert "ok: max |logit difference|" in done.stdout


def test_without_a_gpu_a_cuda_engine_is_refused_in_one_line(engines, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    monkeypatch.delenv("KILN_CUDA_INTERPRET", raising=False)
    with pytest.raises(EngineError) as info:
        LLMEngine.from_dir(engines["nvidia-h100-80gb"].out)
    message = str(info.value)
    assert "\n" not in message and "compute capability 9.0" in message and "KILN_CUDA_INTERPRET=1" in message


def run(path, prompts, params=GREEDY, **options) -> tuple[list[list[int]], LLMEngine]:
    """Tokens of prompts arriving two steps apart (in-flight batching, decode steps of several sizes)."""
    llm = LLMEngine.from_dir(path, EngineOptions(**options))
    ids, pending, steps = {}, list(prompts), 0
    while pending or llm.has_unfinished():
        if pending and steps % 2 == 0:
            ids[llm.add_request(pending.pop(0), params)] = None
        for out in llm.step():
            if out.finished:
                ids[out.request_id] = out.token_ids
        steps += 1
    return list(ids.values()), llm


def test_the_cuda_backend_gives_the_cpu_engines_greedy_tokens(engines, monkeypatch):
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    expected, _ = run(engines["cpu"].out, PROMPTS)
    got, llm = run(engines["nvidia-h100-80gb"].out, PROMPTS)
    assert got == expected
    executor = llm.executor
    assert any(key.startswith("_greedy_kernel") for key in executor.launcher.launched)  # tokens chosen on the device
    graphs = executor.graphs.captured
    assert sum(e.replays for e in graphs.values()) > 0 and len(graphs) >= 2, graphs  # decode steps, padded sizes
    assert set(executor.launcher.launched) <= executor.launcher.allowed  # the engine's own variants only
    assert executor.cache.k[0].dtype.is_floating_point and executor.cache.num_blocks > 0
    # sampled (seeded, top-p, a repetition penalty): the logits go to the host sampler, the cpu engine's draw
    sampled = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7, max_tokens=6,
                             ignore_eos=True)
    assert run(engines["nvidia-h100-80gb"].out, PROMPTS[:2], sampled)[0] == run(engines["cpu"].out, PROMPTS[:2],
                                                                                  sampled)[0]


def test_grammar_masks_and_log_probs_on_the_device_equal_the_cpu_engines(engines, monkeypatch):
    """Greedy requests with a grammar and top-5 log-probs: the mask, greedy and top-logprobs kernels run on the
    device (the logits never copied to the host) and give the cpu engine's tokens and log-probs."""
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5,
                            grammar=regex_grammar("[a-z ]{2,40}"))

    def outputs(path):
        llm = LLMEngine.from_dir(path, EngineOptions())
        return llm.generate(PROMPTS[:3], params), llm

    expected, _ = outputs(engines["cpu"].out)
    got, llm = outputs(engines["nvidia-h100-80gb"].out)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(set(o.text) <= set("abcdefghijklmnopqrstuvwxyz ") for o in got)
    for mine, theirs in zip(got, expected):
        assert len(mine.logprobs) == 6 and all(abs(a - b) < 1e-4 for a, b in zip(mine.logprobs, theirs.logprobs))
        for a, b in zip(mine.top_logprobs, theirs.top_logprobs):  # -inf beside -inf where the mask refused
            assert [i for i, _ in a] == [i for i, _ in b]
            assert all(x == y or abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))
    launched = {key.split(".")[0] for key in llm.executor.launcher.launched}
    assert {"_mask_bits_kernel", "_greedy_kernel", "_top_logprobs_kernel"} <= launched


@pytest.mark.parametrize("family", ["tiny_qwen2_dir", "tiny_mistral_dir", "tiny_phi3_longrope_dir", "tiny_gemma3_dir"])
def test_every_family_gives_the_cpu_engines_greedy_tokens(family, request, tmp_path, monkeypatch):
    """q/k/v biases (Qwen2), sliding windows read through one pool (Mistral, Gemma 3), LongRoPE rows past the
    original length (Phi-3), Gemma's q/k norms, GeGLU and embedding scale: all through the cuda backend's kernels."""
    model = request.getfixturevalue(family)
    plan = cuda_plan()
    plan = plan.with_overrides("limits", max_seq_len=96)
    cpu = build_engine(str(model), exact_plan(method="none"), tmp_path / "cpu", show_progress=False)
    cuda = build_engine(str(model), plan, tmp_path / "cuda", show_progress=False)
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    long_prompt = [(7 * i) % 50 + 3 for i in range(40)]  # past Phi-3's original 32 positions, across windows
    prompts = [PROMPTS[0], long_prompt, PROMPTS[2]]
    assert run(cuda.out, prompts)[0] == run(cpu.out, prompts)[0]


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_weights_give_the_cpu_engines_greedy_tokens(method, tiny_llama_dir, tmp_path, monkeypatch):
    """The same quantized weights (the passes before the layouts are shared) through the int4 and fp8 GEMV/GEMM
    kernels in f32: the cpu engine's tokens. Prompts of 11 tokens take the GEMM kernels, decode steps the GEMV."""
    cpu = build_engine(str(tiny_llama_dir), exact_plan(method=method), tmp_path / "cpu", show_progress=False)
    cuda = build_engine(str(tiny_llama_dir), cuda_plan(method=method, group_size=32), tmp_path / "cuda",
                        show_progress=False)
    assert {n["name"] for n in cuda.manifest["passes"]} >= {f"quantize_{method}", "pack_cuda_weights"}
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    got, llm = run(cuda.out, PROMPTS)
    assert got == run(cpu.out, PROMPTS)[0]
    kernels = {key.split(".")[0] for key in llm.executor.launcher.launched}
    assert {f"{method}_gemv", f"{method}_gemm"} <= kernels, kernels


def test_bf16_activations_and_an_fp8_cache_stay_near_the_f32_engine(tiny_llama_dir, tmp_path, monkeypatch):
    """bf16 activations, int4 weights and an fp8 KV cache (scales calibrated at build) against the cpu engine with
    the same int4 weights and fp8 cache in f32: the same top token, logits within 10% of the largest (measured:
    3.4% for bf16 with a bf16 cache, 6.7% with fp8, where a key bf16 moved can round to the next fp8 step; an
    f32 cuda engine with the fp8 cache agrees to 1e-5, as the interpreter's conversions round as the GPU's)."""
    plan = exact_plan(method="int4").with_overrides("kv_cache", dtype="fp8")
    cpu = build_engine(str(tiny_llama_dir), plan, tmp_path / "cpu", show_progress=False)
    cuda = build_engine(str(tiny_llama_dir), cuda_plan(method="int4", group_size=32, activations="bf16",
                                                       kv_dtype="fp8"), tmp_path / "cuda", show_progress=False)
    assert cuda.manifest["cuda"]["kernels"] >= 8
    reference = engine_logits(cpu.out)
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")  # the backend's kernels in Triton's interpreter
    logits = engine_logits(cuda.out)
    for ids in PROMPTS:
        ours, theirs = logits(ids), reference(ids)
        assert (ours - theirs).abs().max() <= 0.10 * theirs.abs().max(), ids
        assert int(ours.argmax()) == int(theirs.argmax()), ids


def engine_logits(path):
    """ids -> the last position's logits of an engine (its own kernels and KV cache, one prefill step)."""
    import torch

    from runtime.backends.step import StepMetadata

    executor = LLMEngine.from_dir(path).executor

    def logits(ids):
        n = len(ids)
        meta = StepMetadata(torch.tensor(ids), torch.arange(n), torch.arange(n),
                            torch.arange(8, dtype=torch.int32).unsqueeze(0), torch.tensor([n], dtype=torch.int32),
                            torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]))
        return executor.execute(meta)[0].float().cpu().clone()

    return logits


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_rank_processes_give_the_tokens_of_one_rank(tp, pp, engines, tiny_llama_dir, tmp_path, monkeypatch):
    """Tensor and pipeline parallel cuda engines in real rank processes (gloo between them here, NCCL on GPUs):
    a vocabulary-sharded embedding, all-reduces, the logits' all-gather, stages handing over hidden states."""
    from runtime.launcher import open_llm_engine

    plan = cuda_plan().with_overrides(tp=tp, pp=pp)
    built = build_engine(str(tiny_llama_dir), plan, tmp_path / "ranks", show_progress=False)
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    with open_llm_engine(built.out) as llm:
        got = [r.token_ids for r in llm.generate(PROMPTS[:2], GREEDY)]
    assert got == run(engines["cpu"].out, PROMPTS[:2])[0]


def test_the_kernel_benchmark_runs_its_rows_in_the_interpreter(tmp_path):
    """benchmarks/gpu_kernels_bench.py --interpret: every variant compiled for sm_90 as on a GPU, every row (torch,
    Kiln fp8 and int4 linears at one and three tokens; paged and split decode attention) run and equal to torch."""
    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels_bench.py"
    done = subprocess.run([sys.executable, str(script), "--interpret", "--tokens", "1,3",
                           "--batches", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"].split(" (")[0], r["tokens"]) for r in rows} == {
        ("torch bf16", 1), ("Kiln fp8", 1), ("Kiln int4 g128", 1), ("torch bf16", 3), ("Kiln fp8", 3),
        ("Kiln int4 g128", 3), ("paged_attention", 1), ("decode_attention", 1)}
    assert all(r["rel err"] < 1e-2 for r in rows), rows
