"""Pack weights: rewrite logical quantized operands into the CPU kernels' panel layout (runtime.weights, by format)."""

from __future__ import annotations

from builder.graph.ir import Graph
from builder.quant.packing import pack_graph, plan_activations
from passes.context import PassContext
from runtime.weights import QUANTIZED_FORMATS

LAYOUTS = {name: fmt.layout for name, fmt in QUANTIZED_FORMATS.items()}


def pack_weights(graph: Graph, ctx: PassContext) -> Graph:
    # The panel layout is the cpu target's; the tensorrt target exports the logical operands (ONNX Q/DQ).
    return pack_graph(graph, plan_activations(graph, ctx.plan))
