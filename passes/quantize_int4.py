"""Quantize INT4: weights not excluded become group-wise INT4 with zero points (round to nearest, after AWQ)."""

from __future__ import annotations

from builder.ir import Graph
from builder.quant import quantize_int4 as quantize
from passes.context import PassContext
from passes.quant_rewrite import requantize


def quantize_int4(graph: Graph, ctx: PassContext) -> Graph:
    if ctx.plan.quant.method not in ("int4", "int4-awq"):
        return graph
    group_size = ctx.plan.quant.group_size

    def int4(weight):
        q, scales, zeros, error = quantize(weight, group_size)
        return {"qweight": q, "scales": scales, "zeros": zeros}, error

    return requantize(graph, ctx.plan, "int4", group_size, int4)
