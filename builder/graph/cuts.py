"""Where a graph can be cut between its layers: each node's place in the layer list, and the values that cross a
cut (pipeline stages, passes/split_pipeline_stages.py), and the graph cut into one stage a layer (the build's
layer-at-a-time evaluation, builder/measure/evaluation.py, and calibration, builder/measure/calibration.py's LayerSweep)."""

from __future__ import annotations

from builder.errors import KilnError
from builder.graph.ir import Graph, Node


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


def layer_stages(graph: Graph) -> list[Graph]:
    """The graph as one stage a layer, recv/send nodes carrying the values that cross each cut (in order), each
    stage's attention layer numbered 0 for its own pool."""
    num_layers = graph.meta["model"]["num_layers"]
    segment = segments(graph, num_layers)
    stages = []
    for layer in range(num_layers):
        first = -1 if layer == 0 else layer
        last = num_layers if layer == num_layers - 1 else layer
        kept = [n for n in graph.nodes if first <= segment[n.name] <= last]
        received = crossing(graph, segment, first) if layer else []
        sent = crossing(graph, segment, last + 1) if layer < num_layers - 1 else []
        recvs = [Node(f"recv.{v}", "recv", [], [v], {"src": layer - 1, "dtype": graph.values[v].dtype,
                                                       "shape": list(graph.values[v].shape)}) for v in received]
        sends = [Node(f"send.{v}", "send", [v], [], {"dst": layer + 1}) for v in sent]
        stage = graph.replace()
        stage.nodes = recvs + [n for n in stage.nodes if n.name in {k.name for k in kept}] + sends
        stage.outputs = list(graph.outputs) if layer == num_layers - 1 else []
        stage.values = {v.name: v for v in graph.inputs}
        stage.values.update((o, graph.values[o]) for n in stage.nodes for o in n.outputs)
        for node in stage.nodes:
            if node.op == "attention":
                node.attrs["layer"] = 0
        stage.drop_unused_weights()
        stages.append(stage)
    return stages
