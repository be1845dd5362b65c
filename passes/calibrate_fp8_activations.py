"""Calibrate FP8 activations (tensorrt fp8 plans): each fp8 linear's act_scale = max |input| on calibration text / 448.

With it the ONNX lowering puts a QuantizeLinear / DequantizeLinear pair on the linear's input, which TensorRT
folds with the weight's DequantizeLinear into an FP8 GEMM on FP8 tensor cores (compute capability 8.9+). The
runtime's linear reads act_scale too (runtime/ops/program.py), so the build's accuracy measures, which run after
this pass, and the ONNX verification compute what the engine computes.
"""

from __future__ import annotations

from builder.measure.calibration import calibration_windows, sweep_max_abs
from builder.graph.ir import Graph
from passes.context import PassContext
from runtime.weights.fp8 import MAX


def calibrate_fp8_activations(graph: Graph, ctx: PassContext) -> Graph:
    linears = [n for n in graph.nodes if n.op in ("linear", "logits") and n.attrs.get("quant") == "fp8"]
    inputs = {n.inputs[0] for n in linears}
    amax = sweep_max_abs(graph, inputs, calibration_windows(ctx, "FP8 activations"), "fp8 activation scales",
                         ctx.show_progress)
    out = graph.replace()
    for node in out.nodes:
        if node.op in ("linear", "logits") and node.attrs.get("quant") == "fp8":
            largest = amax[node.inputs[0]]
            node.attrs["act_scale"] = largest / MAX if largest > 0 else 1.0
    return out
