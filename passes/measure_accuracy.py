"""Measure accuracy (analysis): perplexity and KL of the quantized whole graph against the float model; the build gate.

Runs when the build loses precision (a requantization method, a KV cache narrower than f16, or
int8 activations) and records manifest figures in graph.meta["accuracy"]; "source" alone keeps the
file's blocks exactly, so it is recorded as exact without an evaluation, and "none" records nothing.
"""

from __future__ import annotations

from builder.accuracy import check_gate, evaluate, reference_graph
from builder.calibration import evaluation_windows
from builder.errors import KilnError
from builder.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import REQUANT_METHODS


def measure_accuracy(graph: Graph, ctx: PassContext) -> Graph:
    quant, kv_dtype = ctx.plan.quant, ctx.plan.kv_cache.dtype
    out = graph.replace()
    errors = out.meta.pop("quant_error", {})
    alphas = out.meta.pop("awq_alpha", {})
    quantized = sum(n.attrs.get("quant", "none") != "none" for n in out.nodes)
    int8_activations = quant.activations == "int8" and quantized > 0
    # An f16 cache alone is not evaluated: it keeps 11 significant bits of K and V (measured on
    # SmolLM2: +0.0005% perplexity, KL 4e-7), and evaluating holds the whole model in memory at once.
    if quant.method not in REQUANT_METHODS and kv_dtype in ("f32", "f16") and not int8_activations:
        if quant.method == "source" and quantized:
            out.meta["accuracy"] = {"method": "source", "evaluated": False, "quantized_nodes": quantized,
                                    "note": "the source's quantized blocks are kept bit for bit: logits equal "
                                            "the dequantized model's"}
        return out
    if ctx.model is None:
        raise KilnError("measure_accuracy: the evaluation needs the model source")
    figures = {"method": quant.method, "kv_cache_dtype": kv_dtype, "activations": quant.activations,
               "quantized_nodes": quantized}
    # Without requantization the graph's weights are the reference's (float, or the source's blocks
    # bit for bit): the graph itself, run exactly, is the reference, and no second model is loaded.
    reference = reference_graph(ctx.model) if quant.method in REQUANT_METHODS else out
    figures.update(evaluate(reference, out, evaluation_windows(ctx), kv_dtype, quant.activations, ctx.show_progress))
    figures["max_ppl_increase"] = quant.max_ppl_increase
    if errors:
        figures["layer_error_max"] = max(errors.values())
        figures["layer_error_mean"] = round(sum(errors.values()) / len(errors), 6)
        figures["layer_error"] = errors
    if alphas:
        figures["awq_alpha"] = alphas
    if kv_dtype in ("int8", "fp8"):
        figures["kv_scale"] = {str(n.attrs["layer"]): n.attrs["kv_scale"] for n in out.nodes if n.op == "attention"}
    check_gate(figures, quant.max_ppl_increase)
    out.meta["accuracy"] = figures
    return out
