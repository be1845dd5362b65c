"""The cuda target and backend without a GPU: plans for sm_80, sm_89 and sm_90a build with cubins in the engine,
byte for byte again; `engine-build verify` passes; and the backend itself (device pools, decode graphs, the
scheduler around it) serves a tiny model through Triton's interpreter with the cpu engine's greedy tokens.

What needs a GPU (the cubins launched, CUDA graphs captured, NCCL) is benchmarks/gpu_check.py's work."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import exact_plan

from builder.build import build_engine
from builder.plan import plan_from_dict
from runtime.engine import EngineOptions, LLMEngine
from runtime.engine_format import EngineError, Manifest, check_files
from runtime.sampling import SamplingParams

pytest.importorskip("triton", reason="the gpu extra (triton) is not installed")

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


def run(path, prompts, **options) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens of prompts arriving two steps apart (in-flight batching, decode steps of several sizes)."""
    llm = LLMEngine.from_dir(path, EngineOptions(**options))
    ids, pending, steps = {}, list(prompts), 0
    while pending or llm.has_unfinished():
        if pending and steps % 2 == 0:
            ids[llm.add_request(pending.pop(0), GREEDY)] = None
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
    graphs = executor.graphs.captured
    assert sum(e.replays for e in graphs.values()) > 0 and len(graphs) >= 2, graphs  # decode steps, padded sizes
    assert set(executor.launcher.launched) <= executor.launcher.allowed  # the engine's own variants only
    assert executor.cache.k[0].dtype.is_floating_point and executor.cache.num_blocks > 0
