"""Clip AWQ weights: each INT4 group's range is shrunk where that lowers its output error on calibration text.

AWQ's second search (after fold_awq_scales): for every weight int4-awq will round, except q_proj
and k_proj (attention scores magnify their error; AWQ leaves them unclipped), each (output
channel, group) is clipped to the fraction of max|w| in {1, 0.95, ..., 0.55} whose rounded
partial products on the calibration activations are closest to the float ones. With rounding
"gptq", quantize_int4_gptq fits each group's range itself, and this pass does nothing.
"""

from __future__ import annotations

from builder.calibration import calibration_windows, capture_activations, progress
from builder.ir import Graph
from builder.quant.awq import awq_clip
from passes.context import PassContext
from passes.quant_rewrite import requant_targets

UNCLIPPED = ("q_proj", "k_proj")


def clip_awq_weights(graph: Graph, ctx: PassContext) -> Graph:
    group_size = ctx.plan.quant.group_size
    out = graph.replace()
    nodes = [n for n in requant_targets(out, ctx.plan) if n.op == "linear" and not n.name.endswith(UNCLIPPED)
             and out.weights[n.inputs[1]].shape[1] % group_size == 0]
    if not nodes:
        return out
    activations = capture_activations(out, {n.inputs[0] for n in nodes}, calibration_windows(ctx, "int4-awq"),
                                      show_progress=ctx.show_progress)
    clipped: dict[str, object] = {}
    for node in progress(nodes, "awq clip", "layer", ctx.show_progress):
        weight = node.inputs[1]
        if weight not in clipped:  # a weight two nodes share is clipped once, on the first one's inputs
            clipped[weight] = awq_clip(activations[node.inputs[0]], out.tensors[weight], group_size)
    for weight, tensor in clipped.items():
        out.tensors[weight] = tensor
    return out
