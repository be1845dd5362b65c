"""Measure accuracy (analysis): perplexity, KL and greedy chat agreement of the quantized whole graph against the
float model; the build gate.

Runs when the build loses precision (a requantization method, a KV cache narrower than f32, or
integer activations) and records manifest figures in graph.meta["accuracy"]; "source" alone keeps the
file's blocks exactly, so it is recorded as exact without an evaluation, and "none" records nothing.
"""

from __future__ import annotations

from builder.measure.accuracy import check_gate, evaluate, reference_graph
from builder.measure.calibration import chat_prompts, evaluation_windows
from builder.errors import KilnError
from builder.graph.ir import Graph
from builder.quant.packing import plan_activations
from passes.context import PassContext
from passes.quant_rewrite import REQUANT_METHODS, weight_nodes
from runtime.backends.activations import INTEGER_ACTIVATIONS


def is_exact(graph: Graph, ctx: PassContext, activations: str) -> bool:
    """Whether the program runs the source's blocks (or float weights) with f32 activations and an f32 cache: the
    one kind of build not evaluated. An f16 cache rounds K and V (SmolLM2: +0.0005% perplexity), so a default build
    measures it too, greedy chat answers included."""
    quant, kv_dtype = ctx.plan.quant, ctx.plan.kv_cache.dtype
    quantized = sum(n.attrs.get("quant", "none") != "none" for n in graph.nodes)
    integer = activations in INTEGER_ACTIVATIONS and quantized > 0
    requantized = graph.meta.get("source_requantized", [])  # GGUF blocks with no exact Kiln format
    return quant.method not in REQUANT_METHODS and kv_dtype == "f32" and not integer and not requantized


def measure_accuracy(graph: Graph, ctx: PassContext) -> Graph:
    quant, kv_dtype = ctx.plan.quant, ctx.plan.kv_cache.dtype
    out = graph.replace()
    errors = out.meta.pop("quant_error", {})
    alphas = out.meta.pop("awq_alpha", {})
    nearest = out.meta.pop("awq_rtn_experts", [])  # experts too few calibration tokens reached: no AWQ scales
    activations = plan_activations(out, ctx.plan)
    measured = out.meta.pop("activation_figures", {})  # what choose_activations measured, by path
    quantized = sum(n.attrs.get("quant", "none") != "none" for n in weight_nodes(out))
    exact = is_exact(out, ctx, activations)
    requantized = out.meta.pop("source_requantized", [])
    if exact:
        if quant.method == "source" and quantized:
            out.meta["accuracy"] = {"method": "source", "evaluated": False, "quantized_nodes": quantized,
                                    "note": "the source's quantized blocks are kept bit for bit: logits equal "
                                            "the dequantized model's"}
        return out
    if ctx.only_rank not in (None, 0):  # one rank of many: the rank-0 build measures the whole program once
        return out
    figures = measured.get(activations) or evaluated(out, ctx, activations, requantized)
    if errors:
        figures["layer_error_max"] = max(errors.values())
        figures["layer_error_mean"] = round(sum(errors.values()) / len(errors), 6)
        figures["layer_error"] = errors
    if alphas:
        figures["awq_alpha"] = alphas
    if nearest:
        figures["awq_rtn_experts"] = nearest
    if kv_dtype in ("int8", "fp8"):
        figures["kv_scale"] = {str(n.attrs["layer"]): n.attrs["kv_scale"] for n in out.nodes if n.op == "attention"}
    check_gate(figures, quant.max_ppl_increase, quant.min_greedy_agreement)
    out.meta["accuracy"] = figures
    return out


def evaluated(out: Graph, ctx: PassContext, activations: str, requantized: list) -> dict:
    """The program's perplexity, KL and greedy chat agreement against the reference, run with `activations`."""
    quant, kv_dtype = ctx.plan.quant, ctx.plan.kv_cache.dtype
    if ctx.model is None:
        raise KilnError("measure_accuracy: the evaluation needs the model source")
    quantized = sum(n.attrs.get("quant", "none") != "none" for n in weight_nodes(out))
    figures = {"method": quant.method, "kv_cache_dtype": kv_dtype, "activations": activations,
               "quantized_nodes": quantized}
    # Without requantization the graph's weights are the reference's (float, or the source's blocks
    # bit for bit): the graph itself, run exactly, is the reference, and no second model is loaded.
    reference = reference_graph(ctx.model) if quant.method in REQUANT_METHODS or requantized else out
    if requantized:
        figures["source_requantized"] = {"format": "int8 group 32", "weights": len(requantized)}
    prompts, templated = chat_prompts(ctx.model)
    # The reference's answers depend on the model's weights and on which reference runs: the float model, or the
    # graph's own weights run exactly (the source's blocks, or its float weights).
    answers_key = {"model": ctx.model.weights_sha256(), "reference": "float" if reference is not out else [
        (n.name, n.attrs.get("quant", "none"), n.attrs.get("group_size")) for n in weight_nodes(out)]}
    figures.update(evaluate(reference, out, evaluation_windows(ctx), kv_dtype, activations, ctx.show_progress,
                            prompts, set(ctx.model.config.eos_token_ids), answers_key))
    figures["greedy_chat_template"] = templated
    figures["max_ppl_increase"] = quant.max_ppl_increase
    figures["min_greedy_agreement"] = quant.min_greedy_agreement
    return figures
