"""Split pipeline stages: keep this rank's stage of the layer list, with recv/send of the values crossing its cuts."""

from __future__ import annotations

import math

from builder.graph.cuts import crossing, segments
from builder.errors import KilnError
from builder.graph.ir import TORCH_DTYPES, Graph, Node
from builder.sources.lazy_tensors import LazyTensors
from passes.context import PassContext
from runtime.format.mapping import Mapping

MATMUL_OPS = ("linear", "logits")


def split_pipeline_stages(graph: Graph, ctx: PassContext) -> Graph:
    mapping = Mapping(ctx.plan.group, ctx.plan.pp, ctx.rank)
    num_layers = graph.meta["model"]["num_layers"]
    segment = segments(graph, num_layers)  # node name -> -1 (before the layers), layer index, or num_layers (after)
    costs = _segment_costs(graph, segment, num_layers)
    try:
        layers = mapping.pp_layers(num_layers, costs[:num_layers], first_cost=costs[-1], last_cost=costs[num_layers])
    except ValueError as exc:
        raise KilnError(f"split_pipeline_stages: {exc}") from None
    out = graph.replace(tensors=LazyTensors.of(graph.tensors))
    out.meta["mapping"] = mapping.to_dict()
    out.meta["stage"] = {"pp_rank": mapping.pp_rank, "layers": [layers.start, layers.stop]}
    if mapping.pp == 1:
        return out

    first = -1 if mapping.is_first_pp_rank() else layers.start
    last = num_layers if mapping.is_last_pp_rank() else layers.stop - 1
    kept = [n for n in out.nodes if first <= segment[n.name] <= last]  # copies: the input graph stays as it was
    received = crossing(graph, segment, first) if not mapping.is_first_pp_rank() else []
    sent = crossing(graph, segment, last + 1) if not mapping.is_last_pp_rank() else []
    recvs = [Node(f"recv.{v}", "recv", [], [v], {"src": mapping.prev_pp_rank(), "dtype": graph.values[v].dtype,
                                                   "shape": list(graph.values[v].shape)}) for v in received]
    sends = [Node(f"send.{v}", "send", [v], [], {"dst": mapping.next_pp_rank()}) for v in sent]
    out.nodes = recvs + kept + sends
    out.outputs = list(graph.outputs) if mapping.is_last_pp_rank() else []
    out.values = {v.name: v for v in graph.inputs}
    out.values.update((o, graph.values[o]) for n in out.nodes for o in n.outputs)
    # The KV cache of a rank holds only its stage's layers: number them from 0.
    for index, node in enumerate(n for n in out.nodes if n.op == "attention"):
        node.attrs["layer"] = index
    out.drop_unused_weights()
    return out


def _segment_costs(graph: Graph, segment: dict[str, int], num_layers: int) -> list[float]:
    """Cost of each layer, then after-the-layers, then before-the-layers: the bytes of matmul
    weights each token reads there (the work per token that sets a stage's step time; an embedding
    lookup reads a few rows, the logits the whole table). Memory per rank is plan_memory's check.
    A graph without matmuls falls back to the bytes of weights stored."""
    stored = [0.0] * (num_layers + 2)
    computed = [0.0] * (num_layers + 2)
    seen: set[str] = set()
    for node in graph.nodes:
        for name in node.inputs:
            if name not in graph.weights:
                continue
            w = graph.weights[name]
            size = math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize
            if name not in seen:  # a tied weight is stored once per stage that uses it; count it once
                stored[segment[node.name]] += size
                seen.add(name)
            if node.op in MATMUL_OPS:
                computed[segment[node.name]] += size
    return computed if sum(computed) else stored
