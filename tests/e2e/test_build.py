"""engine-build end to end: tiny random Llamas and the embedded model against transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from builder.build import build_engine
from builder.graph.interpret import Interpreter
from builder.verify import load_transformers_model
from conftest import exact_plan
from runtime.format.engine_format import map_rank_file

PROMPTS = [[1, 5, 9, 2, 77, 31], [3], list(range(10, 40))]


def engine_logits(engine: Path, ids: list[int]) -> torch.Tensor:
    program, tensors = map_rank_file(engine / "rank0.engine")
    return Interpreter(program, tensors, all_logits=True).logits(ids)


def build(model_dir, out, **plan_changes):
    plan = exact_plan(**plan_changes)
    return build_engine(str(model_dir), plan, out, show_progress=False)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_tied_dir"])
def test_tiny_llama_logits_match_transformers(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    build(model_dir, tmp_path / "engine")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids in PROMPTS:
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        ours = engine_logits(tmp_path / "engine", ids)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_tied_engine_stores_the_embedding_once(tiny_llama_tied_dir, tmp_path):
    build(tiny_llama_tied_dir, tmp_path / "engine")
    program, tensors = map_rank_file(tmp_path / "engine" / "rank0.engine")
    assert "lm_head.weight" not in tensors
    logits_node = [n for n in json.loads(program)["nodes"] if n["op"] == "logits"][0]
    assert logits_node["inputs"][1] == "embed_tokens.weight"


def test_smollm2_engine_matches_transformers_on_the_same_gguf(smollm2_f32_engine, smollm2_gguf):
    reference = load_transformers_model(str(smollm2_gguf))
    ids = [1, 504, 3458, 282, 4649, 314, 216, 28, 253, 1789]
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine_logits(smollm2_f32_engine, ids), expected, atol=1e-3, rtol=0)


def test_rebuild_is_byte_identical(tiny_llama_dir, tmp_path):
    build(tiny_llama_dir, tmp_path / "a")
    build(tiny_llama_dir, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert {"manifest.json", "rank0.engine", "tokenizer.json", "tokenizer_config.json", "report.md"} <= set(names)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_manifest_records_identity_plan_passes_and_hashes(tiny_llama_dir, tmp_path):
    result = build(tiny_llama_dir, tmp_path / "engine")
    m = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert m == result.manifest
    assert m["format"] == "kiln-engine" and m["format_version"] == 2
    assert len(m["model"]["weights_sha256"]) == 64 and m["model"]["config"]["num_kv_heads"] == 2
    assert m["plan"]["quant"]["method"] == "source" and [p["name"] for p in m["passes"]][0] == "canonicalize"
    assert m["target"] == {"name": "cpu", "requires": {"cpu_flags": ["avx2", "fma", "f16c"]}}
    import hashlib
    assert m["ranks"][0]["sha256"] == hashlib.sha256((tmp_path / "engine" / "rank0.engine").read_bytes()).hexdigest()
    chat = json.loads((tmp_path / "engine" / "tokenizer_config.json").read_text())
    assert chat["chat_template"]


def test_an_engine_of_another_format_version_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    from runtime.format.engine_format import FORMAT_VERSION, EngineError
    from runtime.backends import open_engine

    engine = tmp_path / "engine"
    build(tiny_llama_dir, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    (engine / "manifest.json").write_text(json.dumps(dict(manifest, format_version=1)))
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(engine), "-p", "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"engine-run: error: {engine}: engine format version 1 is older than this "
                                  f"runtime reads ({FORMAT_VERSION}); rebuild it with `engine-build build --force ")
    (engine / "manifest.json").write_text(json.dumps(dict(manifest, format_version=FORMAT_VERSION + 1)))
    with pytest.raises(EngineError, match=f"engine format version {FORMAT_VERSION + 1} is newer than this runtime "
                                          f"supports \\({FORMAT_VERSION}\\); upgrade Kiln"):
        open_engine(engine)


def test_the_cpu_flags_engines_require_are_the_ones_the_kernels_are_compiled_for():
    import re
    import tomllib

    from runtime._native import required_cpu_flags

    doc = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    for ext in doc["tool"]["setuptools"]["ext-modules"]:
        flags = [m.group(1) for a in ext["extra-compile-args"] if (m := re.fullmatch(r"-m(\w+)", a))]
        assert flags == required_cpu_flags(), ext["name"]


def test_unchanged_inputs_reuse_the_engine(tiny_llama_dir, tmp_path):
    first = build(tiny_llama_dir, tmp_path / "engine")
    stamp = (tmp_path / "engine" / "rank0.engine").stat().st_mtime_ns
    second = build(tiny_llama_dir, tmp_path / "engine")
    assert not first.up_to_date and second.up_to_date
    assert (tmp_path / "engine" / "rank0.engine").stat().st_mtime_ns == stamp


# ------------------------------------------------------------------ the command line and bad input

def engine_build(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "builder.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


def assert_one_line_error(proc, pattern):
    import re

    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("engine-build: error: ")
    assert re.search(pattern, lines[0]), lines[0]


def assert_nothing_left(parent: Path, keep=()):
    assert sorted(p.name for p in parent.iterdir()) == sorted(keep)


def test_cli_build_inspect_verify(tiny_llama_dir, tmp_path):
    out = tmp_path / "engine"
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", out, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"built: {out}")
    proc = engine_build("inspect", out, "--ir")
    assert proc.returncode == 0, proc.stderr
    assert "plan          cpu target, device cpu, tp 1 x pp 1" in proc.stdout and "= attention(" in proc.stdout
    proc = engine_build("verify", out, "--tolerance", "1e-4")
    assert proc.returncode == 0, proc.stderr
    assert "ok: max |logit difference|" in proc.stdout


def test_verify_judges_int8_activation_engines_by_top1_and_relative_error(tiny_llama_dir, tmp_path):
    out = tmp_path / "engine"
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", out, "--no-progress", "--quant", "int8",
                        "--activations", "int8")
    assert proc.returncode == 0, proc.stderr
    proc = engine_build("verify", out)
    assert proc.returncode == 0, proc.stderr
    assert "ok (int8 activations): top-1 the same on every prompt" in proc.stdout
    proc = engine_build("verify", out, "--tolerance", "1e-6")  # an absolute limit the rounding exceeds
    assert proc.returncode == 1 and proc.stderr.strip().endswith("exceeds --tolerance 1e-06"), proc.stderr


def test_print_after_and_dump_ir(tiny_llama_dir, tmp_path):
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", tmp_path / "e", "--no-progress",
                        "--print-after", "canonicalize", "--dump-ir", tmp_path / "ir")
    assert proc.returncode == 0, proc.stderr
    assert "// IR after canonicalize" in proc.stdout
    dumps = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert dumps[0] == "00-canonicalize.txt" and len(dumps) >= 2


def test_print_after_a_pass_this_build_does_not_run(tiny_llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", tmp_path / "out" / "e", "--no-progress",
                        "--print-after", "quantize_int4")
    assert_one_line_error(proc, r"no pass named 'quantize_int4' in this build's pipeline \(passes that run: "
                                r"canonicalize, keep_source_quant, .*, plan_memory, or all\)")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("case", ["missing", "no_config", "truncated", "architecture"])
def test_bad_model_sources(case, tiny_llama_dir, tmp_path):
    import shutil

    src = tmp_path / "model"
    if case == "missing":
        pattern = "no such file or directory"
    elif case == "no_config":
        src.mkdir()
        pattern = "config.json"
    else:
        shutil.copytree(tiny_llama_dir, src)
        if case == "truncated":
            weights = src / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            pattern = "model.safetensors"
        else:
            config = json.loads((src / "config.json").read_text())
            config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
            (src / "config.json").write_text(json.dumps(config))
            pattern = "gpt2"
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    proc = engine_build("build", "--model", src, "--out", out_parent / "engine", "--no-progress")
    assert_one_line_error(proc, pattern)
    assert_nothing_left(out_parent)


def test_corrupt_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(smollm2_gguf.read_bytes()[:1_000_000])
    (tmp_path / "out").mkdir()
    proc = engine_build("build", "--model", bad, "--out", tmp_path / "out" / "engine", "--no-progress")
    assert_one_line_error(proc, "model.gguf")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("body, pattern", [
    ('target = "cpu"\nbogus = 1\n', "unknown key 'bogus'"),
    ('[limits]\nmax_batch_size = -4\n', r"\[limits\] max_batch_size must be >= 1"),
    ('[kv_cache]\nblock_size = 12\n', "block_size must be a power of two"),
    ('[quant]\nmethod = "int3"\n', r"\[quant\] method must be one of"),
    ('tp = "two"\n', "tp must be an integer"),
    ('[limits\n', "not valid TOML"),
])
def test_bad_plans(body, pattern, tiny_llama_dir, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(body)
    (tmp_path / "out").mkdir()
    proc = engine_build("build", "--model", tiny_llama_dir, "--plan", plan, "--out", tmp_path / "out" / "e")
    assert_one_line_error(proc, pattern)
    assert_nothing_left(tmp_path / "out")


def test_output_dir_holding_something_else_needs_force(tiny_llama_dir, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", out, "--no-progress")
    assert_one_line_error(proc, "holds other files; pass --force")
    assert (out / "notes.txt").read_text() == "keep me"
    proc = engine_build("build", "--model", tiny_llama_dir, "--out", out, "--no-progress", "--force")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "notes.txt").exists() and (out / "manifest.json").is_file()
    assert_nothing_left(tmp_path, keep=["engine"])


@pytest.fixture(scope="session")
def smollm2_f32_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "smollm2-f32"
    build_engine("smollm2-135m", exact_plan(method="none"), out, show_progress=False)
    return out
