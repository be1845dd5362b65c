"""engine-build inspect and verify on real engines: the summary of a cpu and a tensorrt engine, the
manifest as JSON, a newer format version warned about (inspect) or refused (verify), a tampered
rank or ONNX file refused by verify before any logits are computed, and a tensorrt engine's ONNX verified
under ONNX Runtime against the cpu engine, as its build did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.build import build_engine
from conftest import exact_plan
from runtime.core.engine import LLMEngine
from runtime.format.engine_format import FORMAT_VERSION, EngineError
from test_build import assert_one_line_error, engine_build
from test_tensorrt import tensorrt_plan


@pytest.fixture(scope="module")
def cpu_engine(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "cpu-int4"
    build_engine(str(tiny_llama_dir), exact_plan(method="int4", group_size=64), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def tensorrt_engine(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "a100-tp2"
    build_engine(str(tiny_llama_dir), tensorrt_plan(tp=2, activations="f16"), out, show_progress=False,
                 onnx_only=True)
    return out


def sections(stdout: str) -> dict[str, list[str]]:
    """The summary's lines under each label (a continuation line has a blank label)."""
    found, label = {}, None
    for line in stdout.splitlines()[1:]:
        if not line[:1].isspace():
            label = line[:14].strip()
        found.setdefault(label, []).append(line[14:])
    return found


def copy_with_manifest(engine: Path, to: Path, **changes) -> Path:
    shutil.copytree(engine, to)
    manifest = json.loads((to / "manifest.json").read_text())
    (to / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    return to


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ inspect

def test_inspect_summarises_a_cpu_engine(cpu_engine):
    proc = engine_build("inspect", cpu_engine)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    name = json.loads((cpu_engine / "manifest.json").read_text())["model"]["name"]
    assert proc.stdout.startswith(f"{name}: Kiln engine format {FORMAT_VERSION}, written by Kiln ")
    s = sections(proc.stdout)
    assert s["model"][0].startswith(f"{name}: llama, 188,992 parameters, from ")
    assert s["plan"] == ["cpu target, device cpu, tp 1 x pp 1 = 1 rank(s)"]
    assert s["limits"] == ["32 sequences and 512 tokens a step, 2,048 tokens a sequence"]
    assert s["kv cache"][0].startswith("f32, blocks of 16 tokens, 0.5 of the device memory")
    assert s["quantization"] == ["int4, group size 64, f32 activations, excluded: *lm_head*, embed_tokens",
                                 "weight nodes: 16 x int4 g64, 2 x none",
                                 "weights stay quantized in memory and are widened inside the kernels; f32 activations"]
    assert s["accuracy"][0].startswith("perplexity ") and "mean KL" in s["accuracy"][0]
    size = (cpu_engine / "rank0.engine").stat().st_size
    assert s["ranks"][0].startswith("rank 0: rank0.engine ") and f"({size:,} bytes)" in s["ranks"][0]
    assert s["memory"][0].startswith("rank 0: weights ") and " blocks (" in s["memory"][0]
    assert s["requires"][0].startswith("a CPU with avx2, fma, f16c")


def test_inspect_summarises_a_tensorrt_engine(tensorrt_engine):
    proc = engine_build("inspect", tensorrt_engine)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    s = sections(proc.stdout)
    assert s["plan"] == ["tensorrt target, device nvidia-a100-80gb, tp 2 x pp 1 = 2 rank(s)"]
    assert s["quantization"][0] == "int4, group size 32, f16 activations, excluded: *lm_head*, embed_tokens"
    manifest = json.loads((tensorrt_engine / "manifest.json").read_text())
    for rank, line in enumerate(s["ranks"]):
        onnx_bytes = manifest["ranks"][rank]["onnx"]["bytes"]
        assert line.startswith(f"rank {rank}: no rank file (not compiled, --onnx-only); ONNX onnx/rank{rank}/: ")
        assert f"({onnx_bytes:,} bytes); tp rank {rank}, pp rank 0, layers 0..3" in line
    assert len(s["memory"]) == 2
    assert s["requires"][0] == "an NVIDIA GPU of compute capability 8.0 (sm_80)"
    assert s["requires"][1].startswith("not compiled yet (--onnx-only)")
    assert any(line.startswith("verified: onnxruntime (CPU) against the cpu target") for line in s["requires"])


def test_inspect_json_is_the_manifest(cpu_engine):
    proc = engine_build("inspect", cpu_engine, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads((cpu_engine / "manifest.json").read_text())


def test_inspect_warns_on_a_newer_format_version_and_still_summarises(cpu_engine, tmp_path):
    engine = copy_with_manifest(cpu_engine, tmp_path / "newer", format_version=99)
    for args in [(), ("--json",)]:
        proc = engine_build("inspect", engine, *args)
        assert proc.returncode == 0
        assert proc.stderr.splitlines() == [(
            f"engine-build: warning: {engine}: engine format version 99 is newer than this Kiln reads "
            f"({FORMAT_VERSION}); the summary may miss or misread fields and engine-run refuses the engine: "
            "upgrade Kiln")]
    assert json.loads(proc.stdout)["format_version"] == 99
    assert "tp 1 x pp 1" in engine_build("inspect", engine).stdout


def test_inspect_ir_prints_a_cpu_ranks_program_and_refuses_a_tensorrt_one(cpu_engine, tensorrt_engine):
    proc = engine_build("inspect", cpu_engine, "--ir", "--rank", "0")
    assert proc.returncode == 0 and "= attention(" in proc.stdout, proc.stderr
    assert_one_line_error(engine_build("inspect", cpu_engine, "--ir", "--rank", "1"),
                          r"--rank 1: the engine has ranks 0\.\.0")
    assert_one_line_error(engine_build("inspect", tensorrt_engine, "--ir", "--rank", "1"),
                          r"hold ONNX segments, not the IR; rank 1's steps are in onnx/rank1/program\.json")


# ------------------------------------------------------------------ verify

def test_verify_refuses_a_rank_file_with_a_flipped_byte(cpu_engine, tmp_path):
    engine = tmp_path / "tampered"
    shutil.copytree(cpu_engine, engine)
    flip_a_byte(engine / "rank0.engine")
    proc = engine_build("verify", engine)
    assert_one_line_error(proc, rf"{engine}/rank0\.engine: sha256 does not match the manifest")
    assert proc.stdout == ""  # refused before any logits were computed


def test_a_changed_chat_template_or_a_missing_tokenizer_is_refused_in_one_line(cpu_engine, tmp_path):
    """The tokenizer files are hashed as the rank files are: a template edited after the build is refused by verify
    and at start-up, a deleted tokenizer named."""
    manifest = json.loads((cpu_engine / "manifest.json").read_text())
    assert set(manifest["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    engine = tmp_path / "template"
    shutil.copytree(cpu_engine, engine)
    config = json.loads((engine / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (engine / "tokenizer_config.json").write_text(json.dumps(config))
    assert_one_line_error(engine_build("verify", engine),
                          rf"{engine}/tokenizer_config\.json: sha256 does not match the manifest \(the tokenizer")
    with pytest.raises(EngineError, match=r"tokenizer_config\.json: sha256 does not match"):
        LLMEngine.from_dir(engine)
    (engine / "tokenizer_config.json").unlink()
    with pytest.raises(EngineError, match="tokenizer file tokenizer_config.json is missing"):
        LLMEngine.from_dir(engine)


def test_verify_refuses_a_newer_format_version(cpu_engine, tmp_path):
    engine = copy_with_manifest(cpu_engine, tmp_path / "newer", format_version=99)
    proc = engine_build("verify", engine)
    assert_one_line_error(proc, rf"engine format version 99 is newer than this runtime supports "
                                rf"\({FORMAT_VERSION}\); upgrade Kiln")
    assert proc.stdout == ""


def test_verify_runs_a_tensorrt_engines_onnx_against_the_cpu_engine(tensorrt_engine):
    proc = engine_build("verify", tensorrt_engine)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["files: every file the manifest lists matches its sha256",
                         "onnx parity: 2 rank(s) under ONNX Runtime (CPU) against the cpu engine of the same "
                         "quantized program"]
    assert [line.split()[0] for line in lines[2:-1]] == ["prefill", "decode", "mixed", "decode"]
    recorded = json.loads((tensorrt_engine / "manifest.json").read_text())["verification"]
    # the build's own check, run again: the same program and steps give the same figures
    assert lines[-1] == (f"ok: ONNX parity: max |logit difference| {recorded['max_abs_logit_diff']:.3g} <= tolerance "
                         f"{recorded['tolerance']:.3g} (f16 activations, f16 KV cache), top-1 agreement 100%")


def test_verify_refuses_a_tensorrt_engines_missing_corrupt_or_wrong_onnx(tensorrt_engine, tmp_path):
    from runtime.format.engine_format import sha256_file

    flipped = tmp_path / "flipped"
    shutil.copytree(tensorrt_engine, flipped)
    flip_a_byte(flipped / "onnx" / "rank1" / "weights.bin")
    assert_one_line_error(engine_build("verify", flipped),
                          rf"{flipped}/onnx/rank1/weights\.bin: sha256 does not match the manifest")
    missing = tmp_path / "missing"
    shutil.copytree(tensorrt_engine, missing)
    (missing / "onnx" / "rank1" / "segment00.onnx").unlink()
    assert_one_line_error(engine_build("verify", missing), r"rank 1 file onnx/rank1/segment00\.onnx is missing")
    # Other weights under a manifest that lists their hash: only running the ONNX finds them out.
    wrong = tmp_path / "wrong"
    shutil.copytree(tensorrt_engine, wrong)
    weights = wrong / "onnx" / "rank1" / "weights.bin"
    data = weights.read_bytes()
    weights.write_bytes(bytes(len(data) // 2) + data[len(data) // 2:])
    manifest = json.loads((wrong / "manifest.json").read_text())
    manifest["ranks"][1]["onnx"]["files"]["weights.bin"] = sha256_file(weights)
    (wrong / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(engine_build("verify", wrong), r"verify: ONNX parity: ONNX Runtime's logits differ from the "
                                                         r"cpu engine's by \S+ \(limit \S+: f16 activations")


def test_verify_checks_only_the_hashes_of_a_tensorrt_engine_without_onnx(tensorrt_engine, tmp_path):
    ranks = json.loads((tensorrt_engine / "manifest.json").read_text())["ranks"]
    engine = copy_with_manifest(tensorrt_engine, tmp_path / "no-onnx",
                                ranks=[{k: v for k, v in r.items() if k != "onnx"} for r in ranks])
    proc = engine_build("verify", engine)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        "onnx parity: not checked: the manifest lists no ONNX for rank(s) 0, 1",
        "ok: the file hashes are all that can be checked of this engine without a GPU, and they match"]
    assert_one_line_error(engine_build("verify", tensorrt_engine, "--prompt", "hi"),
                          r"--prompt: a tensorrt engine's ONNX is compared on the build's steps")
