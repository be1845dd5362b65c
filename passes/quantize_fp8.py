"""Quantize FP8: weights not excluded become e4m3 with a per-channel scale (the cpu target computes in f32)."""

from __future__ import annotations

import functools

from builder.graph.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import requantize
from runtime.weights import fp8


def quantize_fp8(graph: Graph, ctx: PassContext) -> Graph:
    return requantize(graph, ctx, "fp8", None, functools.partial(fp8.quantize, per_channel=True))
