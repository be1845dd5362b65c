"""IR: text and JSON round trip, and verify() catching broken graphs with the failing pass named."""

import json

import pytest

from builder.errors import KilnError
from builder.graph.ir import Graph, IRError, Node, Value, verify
from builder.sources import load_model
from builder.pipeline import Pass, build_pipeline, run_pipeline
from builder.planning.plan import Plan
from builder.graph.trace import trace
from passes.context import PassContext


@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    return trace(load_model(str(tiny_llama_dir)))


def test_json_round_trip_is_lossless(traced):
    text = traced.to_json()
    back = Graph.from_json(text)
    assert back.to_json() == text
    assert back.format() == traced.format()
    assert back.nodes == traced.nodes and back.values == traced.values and back.weights == traced.weights


def test_text_form_names_ops_types_and_weights(traced):
    text = traced.format()
    assert text.startswith("graph(%tokens: i64[T], %positions: i64[T]) {")
    assert "= attention(%layers.0.self_attn.rope.q, %layers.0.self_attn.rope.k, %layers.0.self_attn.v_proj)" in text
    assert "@layers.0.self_attn.q_proj.weight: f32[64, 64]" in text
    assert text.rstrip().endswith("return %logits\n}")


def test_trace_has_one_node_per_leaf_call(traced):
    ops = [n.op for n in traced.nodes]
    layers = traced.meta["model"]["num_layers"]
    assert ops.count("attention") == layers
    assert ops.count("linear") == 7 * layers
    assert ops[0] == "embedding" and ops[-1] == "logits"


def test_trace_records_each_nodes_layer(traced):
    layers = {n.name: n.layer for n in traced.nodes}
    assert layers["embed_tokens"] is None and layers["lm_head"] is None and layers["norm"] is None
    assert layers["layers.0.self_attn.q_proj"] == 0 and layers["layers.3.mlp_residual"] == 3
    assert all(n.layer == int(n.name.split(".")[1]) for n in traced.nodes if n.name.startswith("layers."))
    assert "# layers.2.mlp.down_proj, layer 2" in traced.format()


def test_a_program_written_before_nodes_had_layers_still_reads():
    doc = json.loads(Graph([], [], [], {}, {}).to_json())
    doc["nodes"] = [{"name": "r", "op": "recv", "inputs": [], "outputs": ["x"], "attrs": {},
                     "types": [{"name": "x", "dtype": "f32", "shape": ["T", 4]}]}]
    assert Graph.from_json(json.dumps(doc)).nodes[0].layer is None


def test_verify_catches_use_before_define(traced):
    broken = traced.replace()
    broken.nodes[1], broken.nodes[2] = broken.nodes[2], broken.nodes[1]
    with pytest.raises(IRError, match="before it is defined"):
        verify(broken)


def test_verify_catches_shape_mismatch(traced):
    broken = traced.replace()
    name = broken.nodes[2].outputs[0]  # q_proj output
    broken.values[name] = Value(name, "f32", ("T", 65))
    with pytest.raises(IRError, match="shape mismatch"):
        verify(broken)


def test_verify_rejects_symbolic_inner_dims():
    v = Value("x", "f32", ("T", "T"))
    g = Graph([v], [], ["x"], {}, {"x": v})
    with pytest.raises(IRError, match="only the leading one may be symbolic"):
        verify(g)


def _breaks_graph(graph, ctx):
    bad = graph.replace()
    node = bad.nodes[3]
    bad.nodes[3] = Node(node.name, node.op, ["no_such_value"] + node.inputs[1:], node.outputs, node.attrs)
    return bad


@pytest.mark.parametrize("debug", [True, False])
def test_pipeline_names_the_failing_pass(traced, debug):
    from builder.pipeline import PipelineOptions

    passes = [build_pipeline(Plan())[0], Pass("break_things", _breaks_graph)]
    with pytest.raises(KilnError, match=r"after pass 'break_things' \(after canonicalize\).*no_such_value"):
        run_pipeline(traced, PassContext(plan=Plan()), passes, PipelineOptions(debug=debug))


def test_print_after_unknown_pass_is_refused(traced):
    from builder.pipeline import PipelineOptions

    with pytest.raises(KilnError, match="no pass named 'fuse_everything'"):
        run_pipeline(traced, PassContext(plan=Plan()), build_pipeline(Plan()),
                     PipelineOptions(print_after="fuse_everything"))
