"""Calibrate KV scales: each attention layer's kv_scale = max |k|, |v| on calibration text / the cache type's max."""

from __future__ import annotations

from builder.measure.calibration import KV_MAX, calibration_windows, sweep_max_abs
from builder.graph.ir import Graph
from passes.context import PassContext


def calibrate_kv_scales(graph: Graph, ctx: PassContext) -> Graph:
    kv_dtype = ctx.plan.kv_cache.dtype
    layers = [n for n in graph.nodes if n.op == "attention"]
    keys_values = {name for n in layers for name in n.inputs[1:3]}  # k after rope, v
    amax = sweep_max_abs(graph, keys_values, calibration_windows(ctx, f"the {kv_dtype} KV cache"), "kv scales",
                         ctx.show_progress)
    out = graph.replace()
    for node in out.nodes:
        if node.op == "attention":
            largest = max(amax[node.inputs[1]], amax[node.inputs[2]])
            node.attrs["kv_scale"] = largest / KV_MAX[kv_dtype] if largest > 0 else 1.0
    return out
