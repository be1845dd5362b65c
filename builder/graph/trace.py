"""Trace a reference module with torch.fx and convert its leaf calls into the Kiln IR."""

from __future__ import annotations

import operator

import torch.fx

from builder.errors import KilnError
from builder.graph.ir import Graph, Node, Value, verify
from builder.graph.ops import LEAVES
from builder.graph.reference import ARCHITECTURES

# Names of each op's outputs, appended to the node name when an op has more than one.
OUTPUT_NAMES = {"rope": ("q", "k")}
WEIGHT_OPS = ("linear", "logits", "embedding")


def trace(model) -> Graph:
    """ModelSpec -> Graph: the program's structure and types; `graph.tensors` is left empty (a build
    fills it with loaders of the model's weights)."""
    cfg = model.config
    if cfg.architecture not in ARCHITECTURES:
        raise KilnError(f"trace: no reference module for architecture {cfg.architecture!r}")
    module = ARCHITECTURES[cfg.architecture](cfg)
    tracer = torch.fx.Tracer(autowrap_functions=tuple(LEAVES.values()))
    fx_graph = tracer.trace(module)
    graph = _convert(fx_graph, module)
    graph.meta = {"model": cfg.to_dict(), "rank": 0, "tp": 1, "pp": 1}
    verify(graph)
    return graph


def _convert(fx_graph: torch.fx.Graph, module: torch.nn.Module) -> Graph:
    params = dict(module.named_parameters())
    # The reference module holds its decoder layers in `module.layers`: module path -> layer index.
    index_of = {id(layer): index for index, layer in enumerate(module.layers)}
    layer_paths = {path: index_of[id(sub)] for path, sub in module.named_modules() if id(sub) in index_of}
    inputs: list[Value] = []
    nodes: list[Node] = []
    values: dict[str, Value] = {}
    weights: dict[str, Value] = {}
    env: dict[torch.fx.Node, object] = {}  # fx node -> IR value name, or a tuple of names

    for fx_node in fx_graph.nodes:
        if fx_node.op == "placeholder":
            value = Value(fx_node.target, "i64", ("T",))
            inputs.append(value)
            values[value.name] = value
            env[fx_node] = value.name
        elif fx_node.op == "get_attr":
            param = params[fx_node.target]
            weights[fx_node.target] = Value(fx_node.target, "f32", tuple(param.shape))
            env[fx_node] = fx_node.target
        elif fx_node.op == "call_function" and fx_node.target is operator.getitem:
            source, index = fx_node.args
            env[fx_node] = env[source][index]
        elif fx_node.op == "call_function" and getattr(fx_node.target, "__name__", None) in LEAVES:
            node = _leaf_node(fx_node, env)
            # The module stack records the modules the call ran inside: its layer, if any.
            stack = fx_node.meta.get("nn_module_stack", {})
            node.layer = next((layer_paths[path] for path in stack if path in layer_paths), None)
            types = _infer(node, [values.get(i) or weights[i] for i in node.inputs])
            for value in types:
                values[value.name] = value
            nodes.append(node)
            env[fx_node] = tuple(node.outputs) if len(node.outputs) > 1 else node.outputs[0]
        elif fx_node.op == "output":
            outputs = [env[fx_node.args[0]]]
        else:
            raise KilnError(f"trace: unexpected {fx_node.op} {fx_node.target} in the reference module")
    return Graph(inputs, nodes, outputs, weights, values)


def _leaf_node(fx_node: torch.fx.Node, env: dict) -> Node:
    op = fx_node.target.__name__
    attrs = dict(fx_node.kwargs)
    name = attrs.pop("name")
    args = [a for a in fx_node.args if a is not None]
    inputs = [env[a] for a in args]
    if op in WEIGHT_OPS:
        attrs["operands"] = ["weight", "bias"][: len(inputs) - 1]
        attrs["quant"] = "none"
    if op == "embedding":
        attrs["vocab_start"] = 0
    if op == "moe":  # each linear inside reads its own weights: roles and format like a linear node's
        attrs["linears"] = [dict(linear, operands=["weight"], quant="none") for linear in attrs["linears"]]
        attrs["experts"] = list(attrs["experts"])
    suffixes = OUTPUT_NAMES.get(op)
    if op == "logits":
        outputs = ["logits"]
    elif suffixes:
        outputs = [f"{name}.{s}" for s in suffixes]
    else:
        outputs = [name]
    return Node(name, op, inputs, outputs, attrs)


def _infer(node: Node, ins: list[Value]) -> list[Value]:
    """Output types of a freshly traced node (activations are f32; rows are T or N)."""
    a, outs, x = node.attrs, node.outputs, ins[0]
    rows = x.shape[0]
    if node.op == "embedding":
        shapes = [(rows, a["hidden_size"])]
    elif node.op in ("linear", "logits"):
        shapes = [(rows, a["out_features"])]
    elif node.op == "rope":
        shapes = [ins[0].shape, ins[1].shape]
    elif node.op == "silu_mul":
        shapes = [x.shape]
    elif node.op == "gather_last":
        shapes = [("N", *x.shape[1:])]
    else:  # rms_norm, head_rms_norm, attention, add keep their first input's shape
        shapes = [x.shape]
    return [Value(o, "f32", s) for o, s in zip(outs, shapes)]

