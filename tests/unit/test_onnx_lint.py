"""builder.targets.tensorrt.onnx_lint on real ONNX models: a clean one passes (and runs in ONNX Runtime), each rule fails.

The clean model is what the tensorrt target emits in miniature: x @ dequantize(block-INT4 weight),
then a `kiln::Scale2` node whose local function is the reference body and whose plugin attributes
name the TensorRT plugin.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder.errors import KilnError
from builder.targets.tensorrt.onnx_lint import lint_model, load_op_table

K, N, BLOCK = 64, 32, 32
TRT = load_op_table("tensorrt", "10.14.1")
RTX = load_op_table("tensorrt-rtx", "1.7.1.116")


def int4_weight() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(K, N), dtype=np.int8)
    scales = rng.uniform(0.01, 0.1, size=(K // BLOCK, N)).astype(np.float32)
    return q, scales


def scale2_function() -> onnx.FunctionProto:
    body = [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])),
            helper.make_node("Mul", ["x", "two"], ["y"])]
    return helper.make_function("kiln", "Scale2", ["x"], ["y"], body, opset_imports=[helper.make_opsetid("", 21)],
                                attributes=["plugin_namespace", "plugin_version"])


def model(nodes: list[onnx.NodeProto] | None = None, initializers: list[onnx.TensorProto] | None = None,
          functions: list[onnx.FunctionProto] | None = None, opset: int = 21,
          plugin_attrs: dict | None = None) -> onnx.ModelProto:
    """x [2, K] -> MatMul with DQ(int4 w, blockwise along K) -> kiln::Scale2 -> out [2, N], plus extras."""
    q, scales = int4_weight()
    attrs = {"plugin_namespace": "kiln", "plugin_version": "1"} if plugin_attrs is None else plugin_attrs
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="layers.0.mlp.dq", axis=0,
                          block_size=BLOCK),
         helper.make_node("MatMul", ["x", "w"], ["h"], name="layers.0.mlp.matmul"),
         helper.make_node("Scale2", ["h"], ["out"], name="layers.0.scale", domain="kiln", **attrs),
         *(nodes or [])],
        "lint",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, N])],
        [helper.make_tensor("w_q", TensorProto.INT4, [K, N], q.flatten().tolist()),
         numpy_helper.from_array(scales, "w_scale"), *(initializers or [])])
    return helper.make_model(graph, ir_version=10, functions=[scale2_function(), *(functions or [])],
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("kiln", 1)])


def only(problems: list[str]) -> str:
    assert len(problems) == 1, problems
    return problems[0]


def test_clean_model_passes_and_runs():
    m = model()
    onnx.checker.check_model(m, full_check=True)
    assert lint_model(m, TRT) == []
    assert lint_model(m, RTX) == []
    x = np.random.default_rng(1).standard_normal((2, K)).astype(np.float32)
    options = ort.SessionOptions()  # unoptimized: ORT would fuse DQ + MatMul into MatMulNBits (int8 activations)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": x})[0]
    q, scales = int4_weight()
    np.testing.assert_allclose(out, 2 * x @ (q * np.repeat(scales, BLOCK, axis=0)), rtol=1e-5, atol=1e-5)


def test_unsupported_op_names_node_op_and_version():
    extra = [helper.make_node("Foo", ["out"], ["foo"], name="layers.0.attn", domain="com.example")]
    assert only(lint_model(model(extra), RTX)) == (
        "node 'layers.0.attn' (com.example::Foo): not supported by TensorRT-RTX 1.7 "
        "(see builder/data/tensorrt_onnx_ops.toml)")
    msg = only(lint_model(model([helper.make_node("RMSNormalization", ["out", "out"], ["n"], name="norm")]), TRT))
    assert msg.startswith("node 'norm' (RMSNormalization): not supported by TensorRT 10.14")


def test_unsupported_op_inside_a_local_function():
    body = [helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="mmi")]
    bad = helper.make_function("kiln", "Bad", ["a", "b"], ["y"], body, opset_imports=[helper.make_opsetid("", 21)])
    msg = only(lint_model(model(functions=[bad]), TRT))
    assert msg.startswith("node 'kiln::Bad/mmi' (MatMulInteger): not supported by TensorRT 10.14")


def test_kiln_node_without_function_or_plugin_attributes():
    orphan = [helper.make_node("Orphan", ["out"], ["o"], name="layers.1.attn", domain="kiln")]
    assert only(lint_model(model(orphan), TRT)).startswith(
        "node 'layers.1.attn' (kiln::Orphan): not supported by TensorRT 10.14")
    problems = lint_model(model(plugin_attrs={"plugin_namespace": "kiln", "plugin_version": 1}), TRT)
    assert only(problems) == ("node 'layers.0.scale' (kiln::Scale2): needs the string attribute plugin_version, "
                              "which names the TensorRT plugin")
    assert len(lint_model(model(plugin_attrs={}), TRT)) == 2


def test_kiln_op_named_like_a_builtin_is_imported_as_the_builtin():
    fn = helper.make_function("kiln", "Attention", ["x"], ["y"], [helper.make_node("Identity", ["x"], ["y"])],
                              opset_imports=[helper.make_opsetid("", 21)])
    node = helper.make_node("Attention", ["out"], ["a"], name="attn", domain="kiln", plugin_namespace="kiln",
                            plugin_version="1")
    assert "imports it as the standard Attention" in only(lint_model(model([node], functions=[fn]), TRT))


@pytest.mark.parametrize("op", ["DequantizeLinear", "QuantizeLinear"])
def test_nonzero_zero_point_is_asymmetric(op):
    source = "q8" if op == "DequantizeLinear" else "out"
    inits = [helper.make_tensor("q8", TensorProto.INT8, [N], [1] * N),
             helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]),
             helper.make_tensor("zp", TensorProto.INT8, [], [3])]
    node = helper.make_node(op, [source, "s", "zp"], ["y"], name="qdq")
    msg = only(lint_model(model([node], inits), TRT))
    assert msg.startswith(f"node 'qdq' ({op}): zero point 'zp' holds nonzero values")
    assert "TensorRT quantization is symmetric" in msg
    inits[2] = helper.make_tensor("zp", TensorProto.INT8, [], [0])
    assert lint_model(model([node], inits), TRT) == []


def test_nonzero_fp8_zero_point_from_a_constant_node():
    zp = helper.make_node("Constant", [], ["zp8"], value=helper.make_tensor("zp8", TensorProto.FLOAT8E4M3FN, [], [1.0]))
    q = helper.make_node("QuantizeLinear", ["out", "s", "zp8"], ["y"], name="to_fp8")
    msg = only(lint_model(model([zp, q], [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5])]), TRT))
    assert msg.startswith("node 'to_fp8' (QuantizeLinear): zero point 'zp8' holds nonzero values")


def test_int4_dequantize_needs_block_size():
    m = model()
    m.graph.node[0].attribute.pop()  # block_size
    msg = only(lint_model(m, TRT))
    assert msg.startswith("node 'layers.0.mlp.dq' (DequantizeLinear): INT4 input without a block_size attribute > 0")


@pytest.mark.parametrize("dtype", [TensorProto.DOUBLE, TensorProto.UINT4, TensorProto.FLOAT8E5M2])
def test_unsupported_initializer_types(dtype):
    init = helper.make_tensor("bad", dtype, [2], [0, 1])
    msg = only(lint_model(model(initializers=[init]), TRT))
    name = TensorProto.DataType.Name(dtype)
    assert msg.startswith(f"initializer 'bad' ({name}): type not supported by TensorRT 10.14")


def test_double_graph_input():
    m = model()
    m.graph.input.append(helper.make_tensor_value_info("d", TensorProto.DOUBLE, [1]))
    assert only(lint_model(m, TRT)).startswith("graph input 'd' (DOUBLE): type not supported by TensorRT 10.14")


def test_opset_above_table():
    msg = only(lint_model(model(opset=TRT.opset_max + 1), TRT))
    assert msg == (f"model: default-domain opset {TRT.opset_max + 1} is above TensorRT 10.14's maximum "
                   f"{TRT.opset_max} (see builder/data/tensorrt_onnx_ops.toml)")


def test_subgraph_nodes_are_checked():
    branch = helper.make_graph([helper.make_node("Det", ["out"], ["d"], name="det")], "then", [],
                               [helper.make_tensor_value_info("d", TensorProto.FLOAT, None)])
    node = helper.make_node("If", ["cond"], ["r"], name="branch", then_branch=branch, else_branch=branch)
    inits = [helper.make_tensor("cond", TensorProto.BOOL, [], [True])]
    problems = lint_model(model([node], inits), TRT)
    assert sorted(problems) == [f"node 'branch/{b}/det' (Det): not supported by TensorRT 10.14 "
                                "(see builder/data/tensorrt_onnx_ops.toml)" for b in ("else_branch", "then_branch")]


@pytest.mark.parametrize("flavour, version",
                         [("tensorrt", "9.3.0"), ("tensorrt-rtx", "2.0"), ("tensorrt-llm", "10.14")])
def test_unknown_version_raises(flavour, version):
    with pytest.raises(KilnError) as err:
        load_op_table(flavour, version)
    message = str(err.value)
    assert "\n" not in message and f"{flavour} {version}" in message
    assert "tensorrt 10.x" in message and "tensorrt-rtx 1.x" in message
