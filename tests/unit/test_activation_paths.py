"""runtime/backends/activations.py: a program's activation paths, and the path a serving host picks among those the build
allowed (timed once, then read from Kiln's cache)."""

import json

import pytest
import torch

from runtime.backends import activations
from runtime.format.engine_format import RankFile
from runtime.weights import int8


def program(out_features: int = 256, in_features: int = 512, act: str | None = None):
    """A one-linear packed program (an int8 weight) as (doc, tensors)."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    packed = int8.pack(codes, torch.rand(out_features, in_features // 32, generator=generator) * 1e-3, 32)
    attrs = {"quant": "int8", "layout": int8.LAYOUT, "in_features": in_features, "out_features": out_features,
             "group_size": 32, "operands": list(packed), **({"act": act} if act else {})}
    names = [f"w.{role}" for role in packed]
    doc = {"nodes": [{"op": "linear", "name": "w", "inputs": ["x", *names], "outputs": ["y"], "attrs": attrs}]}
    return doc, {name: tensor for name, tensor in zip(names, packed.values())}


def test_a_rank_file_is_rebound_to_another_path_with_its_weights():
    doc, tensors = program(act="int16")
    assert activations.program_activations(doc) == "int16"
    rank_file = RankFile(json.dumps(doc), tensors)
    assert activations.rebind(rank_file, "int16") is rank_file
    f32 = activations.rebind(rank_file, "f32")
    assert activations.program_activations(json.loads(f32.program)) == "f32" and f32.tensors is tensors
    int8_doc = json.loads(activations.rebind(f32, "int8").program)
    assert int8_doc["nodes"][0]["attrs"]["act"] == "int8"


def test_the_host_times_the_allowed_paths_once_and_keeps_the_result(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    loads = []

    def load():
        loads.append(1)
        return program()

    first = activations.host_choice("build-a", ["int16", "f32"], "f32", load, threads=1)
    assert first.activations in ("f32", "int16") and set(first.scores) == {"f32", "int16"} and not first.cached
    assert first.scores["f32"] == 1.0 and first.scores["int16"] > 0 and "1 thread(s)" in first.why
    again = activations.host_choice("build-a", ["f32", "int16"], "f32", load, threads=1)
    assert again.cached and again.scores == first.scores and len(loads) == 1
    other = activations.host_choice("build-b", ["f32", "int16"], "f32", load, threads=1)  # another engine
    assert not other.cached and len(loads) == 2
    assert activations.host_choice("build-a", ["f32"], "f32", load).why == "the one path the build allowed"
    assert activations.host_choice("build-a", ["f32", "int16"], "f32", load, "int16").activations == "int16"
    with pytest.raises(ValueError, match=r"^--activations int8: the build allowed f32, int16 \(its accuracy gate"):
        activations.host_choice("build-a", ["f32", "int16"], "f32", load, "int8")
    assert len(loads) == 2  # nothing timed for an answer the build or the user gave


def test_the_most_precise_path_wins_unless_a_coarser_one_gains_enough():
    assert activations.choose({"f32": 1.0, "int16": 1.04}) == ("f32", ["int16"])
    assert activations.choose({"int16": 1.5, "f32": 1.0}) == ("int16", [])
    assert activations.choose({"f32": 1.0, "int16": 1.5, "int8": 1.52}) == ("int16", ["int8"])
    assert activations.choose({"f32": 1.0, "int16": 0.9}) == ("f32", [])


def test_int12_is_timed_apart_from_int16_only_on_amx_tiles(monkeypatch):
    from runtime.ops import linear

    monkeypatch.setattr(linear, "isa", lambda: "avx512")
    assert activations.worth_timing(["f32", "int16", "int12"]) == ["f32", "int16"]
    assert activations.worth_timing(["f32", "int12"]) == ["f32", "int12"]  # int16 refused: int12 stands for itself
    monkeypatch.setattr(linear, "isa", lambda: "amx")
    assert activations.worth_timing(["f32", "int16", "int12"]) == ["f32", "int16", "int12"]
