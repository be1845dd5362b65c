"""[quant] activations = "int8": quantized linears take the int8-activation kernel path, close to f32."""

import json

import torch

from builder.emit import read_rank_program
from builder.interpret import Interpreter


def test_int8_activations_are_recorded_and_stay_close(tiny_llama_dir, build_tiny_engine):
    exact = build_tiny_engine(tiny_llama_dir, "int8-f32", method="int8")
    fast = build_tiny_engine(tiny_llama_dir, "int8-int8", method="int8", activations="int8")
    program, tensors = read_rank_program(fast / "rank0.engine")
    acts = {n["name"]: n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"}
    assert acts["layers.0.self_attn.qkv_proj"] == "int8" and acts["layers.0.mlp.down_proj"] == "int8"
    ids = [3, 17, 99, 4, 250, 8, 41, 7]
    ours = Interpreter(program, tensors, all_logits=True).logits(ids)
    reference = Interpreter(*read_rank_program(exact / "rank0.engine"), all_logits=True).logits(ids)
    assert not torch.equal(ours, reference)  # a different kernel really ran
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75
