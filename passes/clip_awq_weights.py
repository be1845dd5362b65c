"""Clip AWQ weights: each INT4 group's range is shrunk where that lowers its output error on calibration text.

AWQ's second search (after fold_awq_scales): for every weight int4-awq will round, except q_proj
and k_proj (attention scores magnify their error; AWQ leaves them unclipped), each (output
channel, group) is clipped to the fraction of max|w| in {1, 0.95, ..., 0.55} whose rounded
partial products on the calibration activations are closest to the float ones. With rounding
"gptq", quantize_int4_gptq fits each group's range itself, and this pass does nothing.
"""

from __future__ import annotations

from builder.measure.calibration import LayerSweep, calibration_windows
from builder.graph.ir import Graph
from builder.quant.awq import awq_clip_limits, clip_groups
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
    # A layer at a time: each weight's inputs captured where its layer's stage computes them, then its clip
    # searched; the clipped weight is derived from the unclipped one (a streaming build holds only the limits), and
    # the stage had run unclipped, as a whole-graph capture would have.
    clipped: set[str] = set()
    sweep = LayerSweep(out, calibration_windows(ctx, "int4-awq"), "awq clip", ctx.show_progress)
    for stage in sweep:
        here = [n for n in nodes if sweep.stage_of(n.inputs[0]) == stage]
        activations = sweep.run({n.inputs[0] for n in here}, advance=True)
        for node in here:
            weight = node.inputs[1]
            if weight in clipped:  # a weight two nodes share is clipped once, on the first one's inputs
                continue
            clipped.add(weight)
            limits = awq_clip_limits(activations[node.inputs[0]], out.tensors[weight], group_size)
            value = out.weights[weight]
            out.derive_weight(weight, value.dtype, value.shape, [weight], lambda w, c=limits: clip_groups(w, c))
    return out
