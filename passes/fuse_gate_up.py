"""Fuse gate/up: the MLP's two input projections become one linear feeding a one-input silu_mul; inside a moe
node, each expert's (and the shared expert's) gate and up projections become one gate_up_proj linear."""

from __future__ import annotations

import torch

from builder.graph.experts import expert_linears
from builder.graph.ir import Graph, Node
from passes.context import PassContext
from passes.rewrite import can_concat, concat_linears, consumers


def fuse_gate_up(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    users = consumers(out)
    defined_by = {o: n for n in out.nodes for o in n.outputs}
    replace: dict[str, Node | None] = {}  # node name -> replacement node, or None to drop
    for node in out.nodes:
        if node.op != "silu_mul" or len(node.inputs) != 2:
            continue
        gate, up = (defined_by.get(i) for i in node.inputs)
        if gate is None or up is None or not can_concat([gate, up]):
            continue
        if len(users[gate.outputs[0]]) != 1 or len(users[up.outputs[0]]) != 1:
            continue  # another node still needs gate or up on its own
        prefix = gate.name.rsplit(".", 1)[0]
        linear = concat_linears(out, [gate, up], f"{prefix}.gate_up_proj")
        replace[gate.name], replace[up.name] = linear, None
        node.inputs = [linear.outputs[0]]
    out.nodes = [replace.get(n.name, n) for n in out.nodes if replace.get(n.name, n) is not None]
    for node in out.nodes:
        if node.op == "moe":
            _fuse_experts(out, node)
    removed = {o for n in graph.nodes if n.name in replace for o in n.outputs}
    for name in removed:
        out.values.pop(name, None)
    out.drop_unused_weights()
    return out


def _fuse_experts(graph: Graph, node: Node) -> None:
    """Each `<mlp>.gate_proj` and `<mlp>.up_proj` of a moe node (its experts, its shared expert) that can be stacked
    by rows become `<mlp>.gate_up_proj` [gate | up] (runtime.ops.reference.moe runs either form)."""
    views = expert_linears(node)
    by_name = {v.base: v for v in views}
    linears, inputs, fused = [], [node.inputs[0]], set()
    for view in views:
        base = view.base
        prefix = base.rsplit(".", 1)[0]
        if prefix in fused and base.endswith(".up_proj"):
            continue  # already stacked under its gate
        up = by_name.get(f"{prefix}.up_proj") if base.endswith(".gate_proj") else None
        if up is None or not can_concat([view, up]):
            linears.append(view.attrs)
            inputs += view.inputs[1:]
            continue
        name = f"{prefix}.gate_up_proj"
        for role, gate_part, up_part in zip(view.attrs["operands"], view.inputs[1:], up.inputs[1:]):
            stacked = f"{node.name}.{name}.{role}"
            first = graph.weights[gate_part]
            shape = (first.shape[0] + graph.weights[up_part].shape[0], *first.shape[1:])
            graph.derive_weight(stacked, first.dtype, shape, [gate_part, up_part], lambda *ts: torch.cat(ts, dim=0))
            inputs.append(stacked)
        linears.append(dict(view.attrs, name=name, out_features=view.attrs["out_features"] + up.attrs["out_features"]))
        fused.add(prefix)
    node.attrs["linears"], node.inputs = linears, inputs

