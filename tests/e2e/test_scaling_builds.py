"""Builds that scale: a rank built alone (--rank), the parts put together byte for byte as the whole build, and a
quantized build whose float weights in memory are bounded by its largest layer, not by its number of layers."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import exact_plan, make_tiny_llama
from safetensors.torch import load_file

from builder.measure import accuracy
from builder.build import build_engine
from builder.errors import KilnError
from builder.sources.lazy_tensors import LazyTensors
from builder.planning.plan import plan_from_dict
from runtime.weights import int8

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


def test_cuda_ranks_built_alone_make_the_whole_build_with_its_kernels(tiny_llama_dir, tmp_path):
    """A cuda plan's ranks built alone: the kernels every rank launches are found from their files and compiled
    once, at assembly, so the engine (cubins, kernel index, manifest) equals the whole build's byte for byte."""
    plan = plan_from_dict({"target": "cuda", "device": "nvidia-h100-80gb", "tp": 2, "pp": 2,
                           "limits": {"max_batch_size": 4, "max_num_tokens": 16, "max_seq_len": 64},
                           "kv_cache": {"dtype": "f32"}, "quant": {"method": "int4", "activations": "f32"}}, "test")
    whole = build_engine(str(tiny_llama_dir), plan, tmp_path / "whole", show_progress=False)
    out = tmp_path / "parts"
    for rank in (2, 0, 3, 1):
        build_engine(str(tiny_llama_dir), plan, out, rank=rank, show_progress=False)
    assert not (out / "kernels").exists()  # nothing shared yet
    assembled = build_engine(str(tiny_llama_dir), plan, out, show_progress=False)
    assert assembled.manifest["cuda"]["kernels"] == whole.manifest["cuda"]["kernels"] >= 6
    names = sorted(p.relative_to(whole.out) for p in whole.out.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert all((whole.out / n).read_bytes() == (out / n).read_bytes() for n in names)


def test_a_rank_alone_rounds_only_its_own_stages_weights(tiny_llama_dir, tmp_path, monkeypatch):
    """A rank other than 0 measures nothing, so it rounds a weight only when its file reads it: rank 3 (the second
    stage of pp=2) rounds none of the first stage's weights, where the whole build rounds every weight."""
    rounded = []
    original = int8.quantize

    def counted(w, *args, **options):
        if not w.is_meta:
            rounded.append(tuple(w.shape))
        return original(w, *args, **options)

    monkeypatch.setattr(int8, "quantize", counted)
    build_engine(str(tiny_llama_dir), PLAN, tmp_path / "rank3", rank=3, show_progress=False)
    alone = len(rounded)
    rounded.clear()
    build_engine(str(tiny_llama_dir), PLAN, tmp_path / "whole", show_progress=False)
    targets = len(json.loads((tmp_path / "whole" / "manifest.json").read_text())["accuracy"]["layer_error"])
    assert 0 < alone < targets <= len(rounded), (alone, targets, len(rounded))


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
    assert proc.returncode != 0 and "--rank takes cpu and cuda plans" in proc.stderr, proc.stderr
    assert not (tmp_path / "e").exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize("plan", [exact_plan(method="int4"), exact_plan(method="int4-awq"),
                                  exact_plan(method="int4-awq", rounding="nearest"),
                                  exact_plan(method="int8").with_overrides("kv_cache", dtype="int8")],
                         ids=["int4", "int4-awq", "int4-awq-nearest", "int8-kv-int8"])
def test_a_quantized_builds_float_weights_in_memory_follow_its_largest_layer(tmp_path, monkeypatch, plan):
    """The float weight matrices alive at once (every one a build reads, from the source or derived: AWQ's folded
    and clipped weights, GPTQ's rounded ones), through calibration, quantization, the accuracy measures (the float
    reference a layer at a time, as a model over STREAM_BYTES runs) and emission, for 4 and 32 layers of the same
    width: the same bound, while the model is eight times larger."""
    monkeypatch.setattr(accuracy, "STREAM_BYTES", 0)
    original = LazyTensors.__getitem__
    peaks = {}
    for layers in (4, 32):
        alive = {"now": 0, "most": 0}
        tracked: set[int] = set()
        model = make_tiny_llama(tmp_path / f"m{layers}", seed=layers, num_hidden_layers=layers, vocab_size=320)
        matrices = {tuple(t.shape) for t in load_file(model / "model.safetensors").values() if t.dim() == 2}

        def read(self, name, alive=alive, tracked=tracked, matrices=matrices):
            tensor = original(self, name)
            if tensor.dtype == torch.float32 and tuple(tensor.shape) in matrices and id(tensor) not in tracked:
                tracked.add(id(tensor))
                alive["now"] += tensor.nbytes
                alive["most"] = max(alive["most"], alive["now"])

                def gone(key=id(tensor), n=tensor.nbytes):
                    tracked.discard(key)
                    alive["now"] -= n

                weakref.finalize(tensor, gone)
            return tensor

        monkeypatch.setattr(LazyTensors, "__getitem__", read)
        result = build_engine(str(model), plan, tmp_path / f"e{layers}", show_progress=False)
        assert result.manifest["accuracy"]["greedy_prompts"] == 48  # measured, through the streamed reference
        peaks[layers] = (alive["most"], os.path.getsize(model / "model.safetensors"))
    (small, small_model), (large, large_model) = peaks[4], peaks[32]
    assert large_model > 6 * small_model
    assert 0 < large <= 1.25 * small, peaks
