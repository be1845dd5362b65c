"""Quantize INT4: weights not excluded become group-wise INT4 with zero points (round to nearest, after AWQ)."""

from __future__ import annotations

import functools

from builder.graph.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import requantize
from runtime.weights import int4


def quantize_int4(graph: Graph, ctx: PassContext) -> Graph:
    group_size = ctx.plan.quant.group_size
    return requantize(graph, ctx, "int4", group_size, functools.partial(int4.quantize, group_size=group_size))
