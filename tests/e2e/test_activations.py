"""[quant] activations = "int8": quantized linears take the int8-activation kernel path, close to f32."""

import json

import torch

from builder.interpret import Interpreter
from runtime.engine_format import map_rank_file


def test_int8_activations_are_recorded_and_stay_close(tiny_llama_dir, build_tiny_engine):
    exact = build_tiny_engine(tiny_llama_dir, "int8-f32", method="int8")
    fast = build_tiny_engine(tiny_llama_dir, "int8-int8", method="int8", activations="int8")
    program, tensors = map_rank_file(fast / "rank0.engine")
    acts = {n["name"]: n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"}
    assert acts["layers.0.self_attn.qkv_proj"] == "int8" and acts["layers.0.mlp.down_proj"] == "int8"
    ids = [3, 17, 99, 4, 250, 8, 41, 7]
    ours = Interpreter(program, tensors, all_logits=True).logits(ids)
    reference = Interpreter(*map_rank_file(exact / "rank0.engine"), all_logits=True).logits(ids)
    assert not torch.equal(ours, reference)  # a different kernel really ran
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_default_engine_answers_chat_prompts_as_the_float_model(smollm2_default_engine):
    """The default engine (the GGUF's blocks, f32 activations, f16 KV cache) is evaluated at build time
    against the same weights in float32: perplexity, KL and greedy chat answers."""
    manifest = json.loads((smollm2_default_engine / "manifest.json").read_text())
    accuracy = manifest["accuracy"]
    assert (accuracy["activations"], accuracy["kv_cache_dtype"]) == ("f32", "f16")
    assert abs(accuracy["ppl_increase_pct"]) < 0.01 and 0 < accuracy["kl_mean"] < 1e-5
    assert accuracy["greedy_chat_template"] and accuracy["greedy_prompts"] >= 40
    assert accuracy["greedy_agreement_pct"] >= 95.0  # the bar; int8 activations reach 48%
    program, _ = map_rank_file(smollm2_default_engine / "rank0.engine")
    nodes = json.loads(program)["nodes"]
    assert {n["attrs"].get("act") for n in nodes if n["op"] in ("linear", "logits")} == {None}


def test_int16_activations_take_their_kernel_and_stay_closer_than_int8(tiny_llama_dir, build_tiny_engine):
    exact = build_tiny_engine(tiny_llama_dir, "int4-f32", method="int4")
    ids = [3, 17, 99, 4, 250, 8, 41, 7]
    reference = Interpreter(*map_rank_file(exact / "rank0.engine"), all_logits=True).logits(ids)
    errors = {}
    for act in ("int16", "int8"):
        engine = build_tiny_engine(tiny_llama_dir, f"int4-{act}", method="int4", activations=act)
        program, tensors = map_rank_file(engine / "rank0.engine")
        acts = {n["attrs"].get("act") for n in json.loads(program)["nodes"] if n["op"] == "linear"}
        assert acts == {act}
        errors[act] = (Interpreter(program, tensors, all_logits=True).logits(ids) - reference).abs().max()
    assert 0 < errors["int16"] < errors["int8"] / 50  # 8 more bits: about 256x less rounding
