"""Fuse gate/up: the MLP's two input projections become one linear feeding a one-input silu_mul."""

from __future__ import annotations

from builder.ir import Graph, Node
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
    removed = {o for n in graph.nodes if n.name in replace for o in n.outputs}
    for name in removed:
        out.values.pop(name, None)
    out.drop_unused_weights()
    return out
