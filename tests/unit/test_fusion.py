"""Fusion passes: before/after structure on a traced tiny Llama, and numerically the same logits."""

import json

import pytest
import torch
from conftest import canonical_graph

from builder.graph.interpret import Interpreter
from builder.graph.ir import verify
from builder.planning.plan import Plan
from passes.context import PassContext
from passes.fuse_add_rms_norm import fuse_add_rms_norm
from passes.fuse_gate_up import fuse_gate_up
from passes.fuse_qkv import fuse_qkv

CTX = PassContext(plan=Plan())


@pytest.fixture(scope="module")
def graph(tiny_llama_dir):
    return canonical_graph(tiny_llama_dir)[0]


def ops(g, prefix="layers.0."):
    return [(n.op, n.name) for n in g.nodes if n.name.startswith(prefix)]


def logits(g, ids=(3, 17, 99, 4, 250, 8)):
    program = json.loads(g.to_json())
    return Interpreter(json.dumps(program), g.tensors, all_logits=True).logits(list(ids))


def test_fuse_qkv(graph):
    after = fuse_qkv(graph, CTX)
    verify(after)
    assert ops(after)[:4] == [
        ("rms_norm", "layers.0.input_layernorm"),
        ("linear", "layers.0.self_attn.qkv_proj"),
        ("split", "layers.0.self_attn.qkv_split"),
        ("rope", "layers.0.self_attn.rope"),
    ]
    split = next(n for n in after.nodes if n.name == "layers.0.self_attn.qkv_split")
    assert split.attrs["sizes"] == [64, 32, 32]
    assert split.outputs == ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]
    assert after.weights["layers.0.self_attn.qkv_proj.weight"].shape == (128, 64)
    assert "layers.0.self_attn.q_proj.weight" not in after.weights
    torch.testing.assert_close(logits(after), logits(graph), atol=1e-5, rtol=0)


def test_fuse_gate_up(graph):
    after = fuse_gate_up(graph, CTX)
    verify(after)
    mlp = [o for o in ops(after) if ".mlp." in o[1]]
    assert mlp == [("linear", "layers.0.mlp.gate_up_proj"), ("silu_mul", "layers.0.mlp.act"),
                   ("linear", "layers.0.mlp.down_proj")]
    act = next(n for n in after.nodes if n.name == "layers.0.mlp.act")
    assert act.inputs == ["layers.0.mlp.gate_up_proj"]
    torch.testing.assert_close(logits(after), logits(graph), atol=1e-5, rtol=0)


def test_fuse_add_rms_norm(graph):
    after = fuse_add_rms_norm(graph, CTX)
    verify(after)
    fused = next(n for n in after.nodes if n.name == "layers.0.post_attention_layernorm")
    assert fused.op == "add_rms_norm"
    assert fused.outputs == ["layers.0.post_attention_layernorm", "layers.0.attn_residual"]
    # every residual add but the last (which feeds gather_last, not a norm) is fused
    assert [n.name for n in after.nodes if n.op == "add"] == ["layers.3.mlp_residual"]
    torch.testing.assert_close(logits(after), logits(graph), atol=1e-5, rtol=0)


def test_fused_nodes_keep_their_layer(graph):
    after = fuse_add_rms_norm(fuse_gate_up(fuse_qkv(graph, CTX), CTX), CTX)
    layer_of = {n.name: n.layer for n in after.nodes}
    assert layer_of["layers.1.self_attn.qkv_proj"] == layer_of["layers.1.self_attn.qkv_split"] == 1
    assert layer_of["layers.2.mlp.gate_up_proj"] == 2
    # the residual add of layer 0 fused with layer 1's input norm belongs to the norm's layer
    assert layer_of["layers.1.input_layernorm"] == 1 and layer_of["layers.0.post_attention_layernorm"] == 0
    assert layer_of["lm_head"] is None


def test_fusion_leaves_a_linear_with_other_users_alone(graph):
    g = graph.replace()
    gate = next(n for n in g.nodes if n.name == "layers.0.mlp.gate_proj")
    logits_node = g.nodes[-1]
    g.nodes.insert(len(g.nodes) - 1, type(gate)("extra", "add", [gate.outputs[0], gate.outputs[0]], ["extra"], {}))
    g.values["extra"] = g.values[gate.outputs[0]]
    after = fuse_gate_up(g, CTX)
    names = [n.name for n in after.nodes]
    assert "layers.0.mlp.gate_proj" in names and "layers.0.mlp.gate_up_proj" not in names
    assert "layers.1.mlp.gate_up_proj" in names
    assert logits_node.name == after.nodes[-1].name
