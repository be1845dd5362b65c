"""Canonicalize: drop nodes whose outputs nothing uses and weights no node reads; fold shape constants."""

from __future__ import annotations

from builder.graph.ir import Graph
from passes.context import PassContext

# Collectives and sends must run on every rank whether or not this rank reads their result.
KEEP_ALWAYS = ("send", "all_reduce", "all_gather")


def canonicalize(graph: Graph, ctx: PassContext) -> Graph:
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if node.op in KEEP_ALWAYS or any(o in live for o in node.outputs):
            kept.append(node)
            live.update(node.inputs)
    kept.reverse()
    values = {v.name: v for v in graph.inputs}
    values.update((o, graph.values[o]) for n in kept for o in n.outputs)
    out = graph.replace(nodes=kept, values=values)
    for node in out.nodes:
        _fold_shape_attrs(node, out)
    out.drop_unused_weights()
    return out


def _fold_shape_attrs(node, graph: Graph) -> None:
    """Record the static feature sizes a kernel needs as attributes, read off the typed values."""
    if node.op in ("linear", "logits"):
        x, y = graph.type_of(node.inputs[0]), graph.values[node.outputs[0]]
        node.attrs["in_features"], node.attrs["out_features"] = x.shape[-1], y.shape[-1]
    elif node.op == "split":
        node.attrs["sizes"] = [graph.values[o].shape[-1] for o in node.outputs]
