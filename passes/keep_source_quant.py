"""Keep source quantization: a GGUF's quantized blocks become the logical operands of the Kiln format that
holds them exactly (builder/sources/gguf_blocks.py: Q4_0 / Q4_1 / Q4_K as int4, Q5_0 / Q5_1 / Q5_K as int5 and
Q8_0 as int8, group 32; Q6_K as int6, group 16).

Method "source" keeps every weight the file ships quantized; blocks with no exact Kiln format (Q2_K,
Q3_K, the IQ types, ...) are requantized to int8 group-32 from their dequantized values, and
measure_accuracy then evaluates the build. The requantization methods keep the excluded weights' blocks
(for them "higher precision" means what the file ships); "none" keeps all float.
"""

from __future__ import annotations

from builder.sources.gguf_blocks import BLOCK, BLOCK_FORMATS, REQUANT_SOURCE_FORMAT
from builder.sources.gguf_source import FLOAT_TYPES
from builder.graph.ir import Graph
from passes.context import PassContext
from passes.quant_rewrite import is_excluded, is_float_weight_node, logical_operands, quantize_node, weight_nodes
from runtime.weights import FORMATS, int8


def keep_source_quant(graph: Graph, ctx: PassContext) -> Graph:
    method = ctx.plan.quant.method
    if ctx.model is None:  # a graph that did not come from a model source has no blocks to keep
        return graph
    out = graph.replace()
    names = set(ctx.model.weight_names())
    cache: dict = {}
    for node in weight_nodes(out):
        if not is_float_weight_node(node) or node.inputs[1] not in names:
            continue
        if method != "source" and not is_excluded(node, ctx.plan.quant.exclude):
            continue
        raw = ctx.model.raw_blocks(node.inputs[1])
        if raw is not None:
            block = BLOCK_FORMATS[raw.ggml_type]
            quantize_node(out, node, block.quant, block.group_size,
                          lambda _: (dict(zip(FORMATS[block.quant].roles, block.convert(raw))), None), cache)
        elif method == "source" and ctx.model.stored_type(node.inputs[1]) not in (None, *FLOAT_TYPES):
            quantize_node(out, node, REQUANT_SOURCE_FORMAT, BLOCK, _requantize, cache)
            out.meta.setdefault("source_requantized", []).append(node.name)
    out.drop_unused_weights()
    return out


def _requantize(weight):
    quantized = int8.quantize(weight, BLOCK)
    return logical_operands(REQUANT_SOURCE_FORMAT, quantized), quantized.error
