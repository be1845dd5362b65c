"""Quantize INT8: linear/logits/embedding weights not excluded become symmetric per-channel INT8 (weight only)."""

from __future__ import annotations

from builder.graph.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import requantize
from runtime.weights import int8


def quantize_int8(graph: Graph, ctx: PassContext) -> Graph:
    return requantize(graph, ctx, "int8", None, int8.quantize)
