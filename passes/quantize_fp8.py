"""Quantize FP8: weights not excluded become e4m3 with a per-channel scale (the cpu target computes in f32)."""

from __future__ import annotations

from builder.ir import Graph
from builder.quant import quantize_fp8 as quantize
from passes.context import PassContext
from passes.quant_rewrite import requantize


def quantize_fp8(graph: Graph, ctx: PassContext) -> Graph:
    if ctx.plan.quant.method != "fp8":
        return graph
    return requantize(graph, ctx.plan, "fp8", None, _fp8)


def _fp8(weight):
    q, scales, _, error = quantize(weight, per_channel=True)
    return {"qweight": q, "scales": scales}, error
