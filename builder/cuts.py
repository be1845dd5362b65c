"""Where a graph can be cut between its layers: each node's place in the layer list, and the values that cross a
cut (pipeline stages, passes/split_pipeline_stages.py; the build's layer-by-layer evaluation,
builder/evaluation.py)."""

from __future__ import annotations

from builder.errors import KilnError
from builder.ir import Graph


def segments(graph: Graph, num_layers: int) -> dict[str, int]:
    """Each node's place in the layer list: its layer (set by the trace); the nodes outside the
    layers are before the first layer or after the last."""
    segment: dict[str, int] = {}
    seen_layer = False
    for node in graph.nodes:
        if node.layer is not None:
            segment[node.name] = node.layer
            seen_layer = True
        elif not seen_layer:
            segment[node.name] = -1
        else:
            segment[node.name] = num_layers
    order = [segment[n.name] for n in graph.nodes]
    if order != sorted(order):
        late = next(n.name for n, a, b in zip(graph.nodes[1:], order, order[1:]) if b < a)
        raise KilnError(f"node {late!r} is out of layer order; cannot cut the graph between layers")
    return segment


def crossing(graph: Graph, segment: dict[str, int], cut: int) -> list[str]:
    """Values defined before segment `cut` and used from it on, in definition order (both sides of
    a cut compute the same list, so sends and receives pair up in order)."""
    defined_before = [o for n in graph.nodes if segment[n.name] < cut for o in n.outputs]
    used_after = {i for n in graph.nodes if segment[n.name] >= cut for i in n.inputs}
    used_after.update(graph.outputs)
    return [v for v in defined_before if v in used_after]
