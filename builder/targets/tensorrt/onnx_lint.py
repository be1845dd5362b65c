"""Check an ONNX model against what TensorRT's ONNX parser imports, before TensorRT is ever run.

The facts live in builder/data/tensorrt_onnx_ops.toml, one table per flavour ("tensorrt",
"tensorrt-rtx") and major version. `lint_model` returns one line per problem, naming the node (or
tensor), the op and the TensorRT version; an empty list means the model should parse:

- every node of the main graph, of If/Loop/Scan bodies and of local functions is a default-domain
  op the table lists, or a `kiln` node with a local function of its name (TensorRT inlines that
  body, checked like any other, unless a plugin is registered) carrying the string attributes
  plugin_namespace and plugin_version that name the plugin;
- QuantizeLinear/DequantizeLinear zero points known at build time are all zeros (TensorRT
  quantization is symmetric), and an INT4 DequantizeLinear is blockwise (block_size > 0);
- initializers, constants and graph inputs/outputs have element types TensorRT has (no DOUBLE);
- the default-domain opset is not above the table's opset_max.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

import numpy as np
import onnx
import tomllib
from onnx import AttributeProto, TensorProto, numpy_helper

from builder.errors import KilnError

DATA = "builder/data/tensorrt_onnx_ops.toml"
FLAVOURS = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
STANDARD_DOMAINS = ("", "ai.onnx")
KILN_DOMAIN = "kiln"
PLUGIN_ATTRS = ("plugin_namespace", "plugin_version")
QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class OpTable:
    """One table of the data file, for the TensorRT version asked for."""

    flavour: str                    # "tensorrt" or "tensorrt-rtx"
    version: str                    # as asked, e.g. "10.14.1"
    opset_max: int                  # newest default-domain opset
    dtypes: frozenset[str]          # TensorProto names accepted anywhere in the model
    ops: dict[str, str]             # default-domain op -> element types and restrictions
    rejected_dtypes: dict[str, str] = field(default_factory=dict)  # name -> why

    @property
    def label(self) -> str:
        """The flavour and major.minor version, as messages print it: "TensorRT-RTX 1.7"."""
        return f"{FLAVOURS[self.flavour]} {'.'.join(self.version.split('.')[:2])}"


def load_op_table(flavour: str, version: str) -> OpTable:
    """The table for `flavour` whose major version is that of `version` ("10.14.1", "1.7.1.116")."""
    doc = tomllib.loads((resources.files("builder") / "data" / "tensorrt_onnx_ops.toml").read_text())
    spec = doc.get(flavour, {}).get(version.split(".")[0]) if flavour in FLAVOURS else None
    if spec is None:
        known = ", ".join(f"{f} {major}.x" for f in FLAVOURS for major in doc.get(f, {}))
        raise KilnError(f"no ONNX op table for {flavour} {version} in {DATA} (known: {known})")
    ops: dict[str, str] = {}
    if "ops_from" in spec:
        base, major = spec["ops_from"].rsplit(".", 1)
        ops.update(doc[base][major]["ops"])
    ops.update(spec.get("ops", {}))
    return OpTable(flavour=flavour, version=version, opset_max=spec["opset_max"], dtypes=frozenset(spec["dtypes"]),
                   ops=ops, rejected_dtypes=dict(spec.get("rejected_dtypes", {})))


@dataclass
class _Scope:
    """What a graph or function body knows at build time: constant tensors and element types."""

    prefix: str                                   # prepended to node names in messages
    values: dict[str, TensorProto] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)

    def inner(self, prefix: str) -> _Scope:
        return _Scope(prefix, dict(self.values), dict(self.types))


def lint_model(model: onnx.ModelProto, table: OpTable) -> list[str]:
    """One message per problem found; an empty list when the model fits the table."""
    problems: list[str] = []
    functions = {(f.domain, f.name) for f in model.functions}
    _check_opsets(model.opset_import, "model", table, problems)
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for value in values:
            if value.type.HasField("tensor_type"):
                _check_dtype(f"graph {kind} '{value.name}'", value.type.tensor_type.elem_type, table, problems)
    _check_graph(model.graph, _Scope(""), functions, table, problems)
    for function in model.functions:
        name = f"{function.domain}::{function.name}"
        _check_opsets(function.opset_import, f"function {name}", table, problems)
        scope = _Scope(f"{name}/")
        _add_constants(function.node, scope, table, problems)
        _check_nodes(function.node, scope, functions, table, problems)
    return problems


def _check_opsets(opsets, where: str, table: OpTable, problems: list[str]) -> None:
    for opset in opsets:
        if opset.domain in STANDARD_DOMAINS and opset.version > table.opset_max:
            problems.append(f"{where}: default-domain opset {opset.version} is above {table.label}'s maximum "
                            f"{table.opset_max} (see {DATA})")


def _check_dtype(where: str, dtype: int, table: OpTable, problems: list[str]) -> None:
    name = TensorProto.DataType.Name(dtype)
    if dtype != TensorProto.UNDEFINED and name not in table.dtypes:
        why = table.rejected_dtypes.get(name, "not in its list of types")
        problems.append(f"{where} ({name}): type not supported by {table.label}: {why} (see {DATA})")


def _check_graph(graph: onnx.GraphProto, scope: _Scope, functions: set[tuple[str, str]], table: OpTable,
                 problems: list[str]) -> None:
    for init in graph.initializer:
        _check_dtype(f"initializer '{scope.prefix}{init.name}'", init.data_type, table, problems)
        scope.values[init.name], scope.types[init.name] = init, init.data_type
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.HasField("tensor_type"):
            scope.types.setdefault(value.name, value.type.tensor_type.elem_type)
    _add_constants(graph.node, scope, table, problems)
    _check_nodes(graph.node, scope, functions, table, problems)


def _add_constants(nodes, scope: _Scope, table: OpTable, problems: list[str]) -> None:
    for node in nodes:
        if node.op_type == "Constant" and node.domain in STANDARD_DOMAINS:
            for attr in node.attribute:
                if attr.name == "value" and attr.type == AttributeProto.TENSOR:
                    _check_dtype(f"constant '{scope.prefix}{node.output[0]}'", attr.t.data_type, table, problems)
                    scope.values[node.output[0]], scope.types[node.output[0]] = attr.t, attr.t.data_type


def _check_nodes(nodes, scope: _Scope, functions: set[tuple[str, str]], table: OpTable,
                 problems: list[str]) -> None:
    for index, node in enumerate(nodes):
        name = f"{scope.prefix}{node.name or f'#{index}'}"
        op = node.op_type if node.domain in STANDARD_DOMAINS else f"{node.domain}::{node.op_type}"
        where = f"node '{name}' ({op})"
        attrs = {a.name: a for a in node.attribute}
        if node.domain == KILN_DOMAIN and (node.domain, node.op_type) in functions:
            if node.op_type in table.ops:  # the parser picks importers by op_type, ignoring the domain
                problems.append(f"{where}: {table.label}'s parser imports it as the standard {node.op_type}, "
                                f"not through its function; rename the kiln op")
            for key in PLUGIN_ATTRS:
                if key not in attrs or attrs[key].type != AttributeProto.STRING:
                    problems.append(f"{where}: needs the string attribute {key}, which names the TensorRT plugin")
        elif node.domain not in STANDARD_DOMAINS or node.op_type not in table.ops:
            problems.append(f"{where}: not supported by {table.label} (see {DATA})")
            continue
        elif node.op_type in QDQ:
            _check_qdq(node, where, attrs, scope, table, problems)
        for attr in node.attribute:
            for sub in (attr.g,) if attr.type == AttributeProto.GRAPH else attr.graphs:
                _check_graph(sub, scope.inner(f"{name}/{attr.name}/"), functions, table, problems)


def _check_qdq(node: onnx.NodeProto, where: str, attrs: dict, scope: _Scope, table: OpTable,
               problems: list[str]) -> None:
    zero_point = node.input[2] if len(node.input) > 2 else ""
    if zero_point in scope.values and np.any(numpy_helper.to_array(scope.values[zero_point]).astype(np.float32)):
        problems.append(f"{where}: zero point '{zero_point}' holds nonzero values, but TensorRT quantization "
                        f"is symmetric: {table.label} needs it absent or all zeros")
    types = {scope.types.get(node.input[0]), scope.types.get(zero_point)}
    if node.op_type == "DequantizeLinear" and TensorProto.INT4 in types:
        block = attrs["block_size"].i if "block_size" in attrs else 0
        if block <= 0:
            problems.append(f"{where}: INT4 input without a block_size attribute > 0; {table.label} dequantizes "
                            f"INT4 (weights) only blockwise (see {DATA})")
