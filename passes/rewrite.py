"""Helpers shared by rewriting passes: use lists and row-wise concatenation of sibling linears."""

from __future__ import annotations

from collections import defaultdict

import torch

from builder.graph.ir import Graph, Node, Value


def consumers(graph: Graph) -> dict[str, list[Node]]:
    """Value name -> nodes that read it, in program order."""
    users: dict[str, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        for name in node.inputs:
            users[name].append(node)
    return users


def can_concat(linears: list[Node]) -> bool:
    """Linears (or linears inside one moe node, builder/graph/experts.py) whose operands can be stacked by output rows:
    same input, scheme and operand roles."""
    first = linears[0].attrs
    same = ("quant", "group_size", "operands", "in_features")
    return (all(n.op == linears[0].op and n.op in ("linear", "moe_linear") for n in linears)
            and all(n.inputs[0] == linears[0].inputs[0] for n in linears)
            and all(n.attrs.get(k) == first.get(k) for n in linears for k in same)
            and first.get("layout", "logical") == "logical")


def concat_linears(graph: Graph, linears: list[Node], name: str) -> Node:
    """One linear computing all of `linears` side by side: every operand stacked along dim 0.

    Adds the stacked weights to `graph` (the originals stay until dropped as unused) and returns
    the new node, whose single output `name` is [rows, sum of out_features].
    """
    roles = linears[0].attrs["operands"]
    inputs = [linears[0].inputs[0]]
    for i, role in enumerate(roles, start=1):
        fused = f"{name}.{role}"
        parts = [n.inputs[i] for n in linears]
        first = graph.weights[parts[0]]
        shape = (sum(graph.weights[p].shape[0] for p in parts), *first.shape[1:])
        graph.derive_weight(fused, first.dtype, shape, parts, lambda *ts: torch.cat(ts, dim=0))
        inputs.append(fused)
    out_features = sum(n.attrs["out_features"] for n in linears)
    attrs = dict(linears[0].attrs, out_features=out_features)
    rows = graph.values[linears[0].outputs[0]].shape[0]
    graph.values[name] = Value(name, "f32", (rows, out_features))
    return Node(name, "linear", inputs, [name], attrs, linears[0].layer)
