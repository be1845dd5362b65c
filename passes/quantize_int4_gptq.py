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

import functools

import torch
from builder.measure.calibration import MAX_TOKENS, LayerSweep, calibration_windows
from builder.errors import KilnError
from builder.graph.ir import Graph, Node
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
    # A layer at a time (builder/measure/calibration.py's LayerSweep): a layer's inputs are captured by running its stage
    # with the layers before it rounded and its own weights float; its rounded weights then override the float
    # ones for the run that hands the stage's values on. Two runs a stage, where capturing through the whole graph
    # for every layer ran the model's first half again for each (and held the whole float model).
    sweep = LayerSweep(out, calibration_windows(ctx, "int4-awq"), "gptq", ctx.show_progress)
    layers: dict[int, list[dict[str, list[Node]]]] = {}
    for layer in _layers(nodes):
        stages = {sweep.stage_of(name) for name in layer}
        if len(stages) > 1:
            raise KilnError(f"int4-awq: the inputs of {next(iter(layer.values()))[0].name}'s layer are computed in "
                            f"different layers ({sorted(stages)}); GPTQ rounds a layer at a time")
        layers.setdefault(stages.pop(), []).append(layer)
    for stage in sweep:
        approx: dict[str, torch.Tensor] = {}  # this stage's rounded weights, read instead of the float ones
        for layer in layers.get(stage, []):
            activations = sweep.run(set(layer), approx, max_rows=MAX_TOKENS)
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
                    approx[weight_name := node.inputs[1]] = int4.dequantize(*parts.values())
                    error = relative_error(weight, approx[weight_name])
                    quantize_node(out, node, "int4", group_size, lambda _w, p=parts, e=error: (p, e), {})
                    _hold_as_nibbles(out, node.inputs[1])
                del weights, stacked, found
        sweep.run(set(), approx, advance=True)
    out.drop_unused_weights()
    return out


def _hold_as_nibbles(graph: Graph, name: str) -> None:
    """A streaming build holds GPTQ's codes (uint8 [N, K], 0..15) two a byte until they are written, and gives
    them back as they were whenever they are read."""
    if not hasattr(graph.tensors, "bind"):
        return
    graph.tensors.bind(name, functools.partial(int4.unpack_nibbles, int4.pack_nibbles(graph.tensors[name])))


def _layers(nodes: list[Node]) -> list[dict[str, list[Node]]]:
    """The nodes' inputs in graph order, grouped by transformer layer (the trace's `layer`), each
    input with the nodes that read it; nodes outside any layer form a group of their own."""
    layers: dict[int | str, dict[str, list[Node]]] = {}
    for node in nodes:
        key = node.name if node.layer is None else node.layer
        layers.setdefault(key, {}).setdefault(node.inputs[0], []).append(node)
    return list(layers.values())
