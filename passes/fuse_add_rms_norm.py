"""Fuse residual add + rms_norm into add_rms_norm, which returns the normed value and the sum."""

from __future__ import annotations

from builder.graph.ir import Graph, Node
from passes.context import PassContext
from passes.rewrite import consumers


def fuse_add_rms_norm(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    users = consumers(out)
    fused: dict[str, Node] = {}  # add node name -> fused node
    dropped: set[str] = set()    # rms_norm nodes absorbed into a fused node
    for node in out.nodes:
        if node.op != "add":
            continue
        norms = [u for u in users[node.outputs[0]] if u.op == "rms_norm"]
        if len(norms) != 1:
            continue
        norm = norms[0]
        x, residual = node.inputs
        # Named after the norm and in its layer: a pipeline cut keeps the add with the norm reading it.
        fused[node.name] = Node(f"{norm.name}", "add_rms_norm", [x, residual, norm.inputs[1]],
                                [norm.outputs[0], node.outputs[0]], dict(norm.attrs), norm.layer)
        dropped.add(norm.name)
    out.nodes = [fused.get(n.name, n) for n in out.nodes if n.name not in dropped]
    return out
