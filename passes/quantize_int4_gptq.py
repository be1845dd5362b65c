"""Quantize INT4 with GPTQ: int4-awq's linears are rounded layer by layer, each rounding error compensated.

After fold_awq_scales has scaled the weights, each linear int4-awq rewrites gets
  1. a grid per group fitted to its inputs' activity (fit_int4_grid: asymmetric ranges searched and
     refined by weighted least squares, which subsumes clip_awq_weights' range search), then
  2. GPTQ rounding on that grid (gptq_int4): each column's rounding error is absorbed by the columns
     rounded after it, through the second moments of the linear's inputs on the calibration text.
Layers go in order, and each layer's inputs are captured with the layers before it already rounded,
so a layer also makes up for the error that reaches it. Linears reading one input (q/k/v, gate/up)
are rounded as one stacked matrix. quantize_int4 (the pass) then rounds whatever is left (nothing, for llama).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from builder.calibration import MAX_TOKENS, calibration_windows, capture_activations
from builder.ir import Graph, Node
from builder.quant.gptq import fit_int4_grid, gptq_int4
from passes.context import PassContext
from passes.quant_rewrite import quantize_node, requant_targets
from passes.rewrite import consumers
from runtime.weights import int4
from runtime.weights.format import relative_error



def quantize_int4_gptq(graph: Graph, ctx: PassContext) -> Graph:
    group_size = ctx.plan.quant.group_size
    out = graph.replace()
    users = consumers(out)
    nodes = [n for n in requant_targets(out, ctx.plan) if n.op == "linear"
             and out.weights[n.inputs[1]].shape[1] % group_size == 0 and len(users[n.inputs[1]]) == 1]
    if not nodes:
        return out
    windows = calibration_windows(ctx, "int4-awq")
    working = out.replace()  # the float graph, each layer's weights replaced by their rounding once done
    rounded: dict[str, tuple[Node, dict[str, torch.Tensor], float]] = {}
    for layer in tqdm(_layers(nodes), desc="gptq", unit="layer", leave=False, disable=not ctx.show_progress):
        activations = capture_activations(working, set(layer), windows, max_rows=MAX_TOKENS)
        for name, readers in layer.items():
            weights = [out.tensors[n.inputs[1]].float() for n in readers]
            x = activations.pop(name)
            stacked = torch.cat(weights)
            found = gptq_int4(stacked, x, group_size, fit_int4_grid(stacked, x.pow(2).mean(0), group_size))
            start = 0
            for node, weight in zip(readers, weights):
                rows = slice(start, start + weight.shape[0])
                start = rows.stop
                parts = {"qweight": found.q[rows], "scales": found.scales[rows], "zeros": found.zeros[rows]}
                approx = int4.dequantize(*parts.values())
                working.tensors[node.inputs[1]] = approx
                rounded[node.name] = (node, parts, relative_error(weight, approx))
    for node, parts, error in rounded.values():
        quantize_node(out, node, "int4", group_size, lambda _w, p=parts, e=error: (p, e), {})
    out.drop_unused_weights()
    return out


def _layers(nodes: list[Node]) -> list[dict[str, list[Node]]]:
    """The nodes' inputs in graph order, grouped by transformer layer (the trace's `layer`), each
    input with the nodes that read it; nodes outside any layer form a group of their own."""
    layers: dict[int | str, dict[str, list[Node]]] = {}
    for node in nodes:
        key = node.name if node.layer is None else node.layer
        layers.setdefault(key, {}).setdefault(node.inputs[0], []).append(node)
    return list(layers.values())
