"""Builds that scale: a rank built alone (--rank), the parts put together byte for byte as the whole build, and a
quantized build whose float weights in memory are bounded by its largest layer, not by its number of layers."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import weakref

import pytest
from conftest import exact_plan, make_tiny_llama

from builder import accuracy
from builder.build import build_engine
from builder.errors import KilnError
from builder.model import ModelSpec

PLAN = exact_plan(method="int8").with_overrides(tp=2, pp=2)


def engine_build(*args):
    return subprocess.run([sys.executable, "-m", "builder.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def same_directories(a, b) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


@pytest.fixture(scope="module")
def whole(tiny_llama_dir, tmp_path_factory):
    return build_engine(str(tiny_llama_dir), PLAN, tmp_path_factory.mktemp("whole") / "e", show_progress=False).out


def test_ranks_built_alone_in_any_order_make_the_whole_build_byte_for_byte(tiny_llama_dir, whole, tmp_path):
    out = tmp_path / "parts"
    for rank in (3, 1):
        build_engine(str(tiny_llama_dir), PLAN, out, rank=rank, show_progress=False)
    # the CLI, as a CI job would run it
    proc = engine_build("build", "--model", tiny_llama_dir, "--quant", "int8", "--activations", "f32", "--kv-dtype",
                        "f32", "--tp", 2, "--pp", 2, "--out", out, "--rank", 0, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "built: rank 0 of 4" in proc.stdout
    with pytest.raises(KilnError, match=r"holds the parts of ranks 0, 1, 3 of this build, not of ranks 2: build "
                                        r"those with --rank"):
        build_engine(str(tiny_llama_dir), PLAN, out, show_progress=False)
    again = build_engine(str(tiny_llama_dir), PLAN, out, rank=1, show_progress=False)
    assert again.up_to_date  # its file and part are already there
    build_engine(str(tiny_llama_dir), PLAN, out, rank=2, show_progress=False)
    assembled = build_engine(str(tiny_llama_dir), PLAN, out, show_progress=False)
    assert not assembled.up_to_date and "accuracy" in assembled.manifest  # measured by the rank-0 build
    assert same_directories(whole, out)  # manifest, report and tokenizer too; no part left behind


def test_a_rank_file_that_changed_is_not_assembled(tiny_llama_dir, tmp_path):
    out = tmp_path / "parts"
    for rank in range(4):
        build_engine(str(tiny_llama_dir), PLAN, out, rank=rank, show_progress=False)
    data = bytearray((out / "rank2.engine").read_bytes())
    data[-1] ^= 0xFF
    (out / "rank2.engine").write_bytes(bytes(data))
    with pytest.raises(KilnError, match=r"rank2\.engine is missing or is not the file rank 2's build wrote .*--rank 2"):
        build_engine(str(tiny_llama_dir), PLAN, out, show_progress=False)
    assert not (out / "manifest.json").exists()


def test_bad_ranks_are_refused_in_one_line(tiny_llama_dir, tmp_path):
    proc = engine_build("build", "--model", tiny_llama_dir, "--tp", 2, "--rank", 2, "--out", tmp_path / "e")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "--rank 2: the plan has 2 rank(s) (tp 2 x pp 1), numbered 0 to 1" in lines[0]
    proc = engine_build("build", "--model", tiny_llama_dir, "--plan", "plans/a100-tp2-int4.toml", "--rank", 0,
                        "--out", tmp_path / "t")
    assert proc.returncode != 0 and "--rank takes cpu plans" in proc.stderr, proc.stderr
    assert not (tmp_path / "e").exists() and not (tmp_path / "t").exists()


def test_a_quantized_builds_float_weights_in_memory_follow_its_largest_layer(tmp_path, monkeypatch):
    """The float weights alive at once, through quantization, the accuracy measures (the float reference a layer at
    a time, as a model over STREAM_BYTES runs) and emission, for 4 and 32 layers of the same width: the
    same bound, while the model is eight times larger."""
    monkeypatch.setattr(accuracy, "STREAM_BYTES", 0)
    original = ModelSpec.load
    peaks = {}
    for layers in (4, 32):
        alive = {"now": 0, "most": 0, "total": 0}

        def tracked(self, name, alive=alive):
            tensor = original(self, name)
            alive["now"] += tensor.nbytes
            alive["most"] = max(alive["most"], alive["now"])
            weakref.finalize(tensor, lambda n=tensor.nbytes: alive.__setitem__("now", alive["now"] - n))
            return tensor

        monkeypatch.setattr(ModelSpec, "load", tracked)
        model = make_tiny_llama(tmp_path / f"m{layers}", seed=layers, num_hidden_layers=layers, vocab_size=320)
        result = build_engine(str(model), exact_plan(method="int4"), tmp_path / f"e{layers}", show_progress=False)
        assert result.manifest["accuracy"]["greedy_prompts"] == 48  # measured, through the streamed reference
        sizes = [os.path.getsize(f) for f in model.glob("*.safetensors")]
        peaks[layers] = (alive["most"], sum(sizes))
    (small, small_model), (large, large_model) = peaks[4], peaks[32]
    assert large_model > 6 * small_model
    assert large <= 1.25 * small, peaks
