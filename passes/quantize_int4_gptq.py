"""Quantize INT4 with GPTQ: int4-awq's linears are rounded column by column, each column's error compensated.

After fold_awq_scales and clip_awq_weights have set each group's range, gptq_int4 rounds every
linear int4-awq rewrites on the calibration activations of its input, all of them (not a sample):
the inputs' second moments decide how one column's rounding error is absorbed by the columns
rounded after it. Linears reading one input (q/k/v, gate/up) share those moments and are rounded
as one stacked matrix. quantize_int4 then rounds whatever is left (nothing, for a llama graph).
"""

from __future__ import annotations

import torch

from builder.calibration import MAX_TOKENS, calibration_windows, capture_activations
from builder.ir import Graph
from builder.quant import dequantize_int4, gptq_int4, relative_error
from passes.context import PassContext
from passes.quant_rewrite import quantize_node, requant_targets
from passes.rewrite import consumers


def quantize_int4_gptq(graph: Graph, ctx: PassContext) -> Graph:
    if ctx.plan.quant.method != "int4-awq" or ctx.plan.quant.rounding != "gptq":
        return graph
    group_size = ctx.plan.quant.group_size
    out = graph.replace()
    users = consumers(out)
    nodes = [n for n in requant_targets(out, ctx.plan) if n.op == "linear"
             and out.weights[n.inputs[1]].shape[1] % group_size == 0 and len(users[n.inputs[1]]) == 1]
    if not nodes:
        return out
    by_input: dict[str, list] = {}
    for node in nodes:
        by_input.setdefault(node.inputs[0], []).append(node)
    activations = capture_activations(out, set(by_input), calibration_windows(ctx, "int4-awq"), max_rows=MAX_TOKENS)
    for name, readers in by_input.items():
        weights = [out.tensors[n.inputs[1]] for n in readers]
        found = gptq_int4(torch.cat([w.float() for w in weights]), activations.pop(name), group_size)
        start = 0
        for node, weight in zip(readers, weights):
            rows = slice(start, start + weight.shape[0])
            start = rows.stop
            parts = {"qweight": found.q[rows], "scales": found.scales[rows], "zeros": found.zeros[rows]}
            error = relative_error(weight, dequantize_int4(*parts.values()))
            quantize_node(out, node, "int4", group_size, lambda _w, p=parts, e=error: (p, e), {})
    out.drop_unused_weights()
    return out
