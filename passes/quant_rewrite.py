"""Helpers shared by the quantization passes: which nodes a method rewrites, and giving a node quantized operands.

A quantized linear/logits/embedding node keeps its op; attrs quant ("int8" | "int4" | "fp8", or a
GGUF's "int5" | "int6"), group_size (None: one scale per output channel), layout "logical" until
pack_weights, and operands = the roles of inputs[1:] with the quantized roles first (then "bias").
Logical operands are named after the float weight they replace, `<name minus .weight>.qweight` /
`.scales` / `.zeros` / `.mins` (the roles of the format in runtime.weights.FORMATS):
  qweight  [N, K]  int8 | uint8 codes 0..15 (int4), 0..31 (int5), 0..63 (int6) | float8_e4m3fn
  scales   [N] f32 per channel, or [N, K/G] per group
  zeros    [N, K/G] f32 (int4: w = (q - 8) * scale + zero)
  mins     [N, K/G] f32 (int5: w = fma(q, scale, min); int6 has none: w = (q - 32) * scale)
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

import torch

from builder.errors import KilnError
from builder.graph.experts import FLOAT_LINEARS, graph_expert_linears
from builder.graph.ir import Graph, Node
from builder.sources.lazy_tensors import PartsMemo
from builder.quant import methods
from runtime.weights import FORMATS
from runtime.weights.format import Quantized

WEIGHT_OPS = ("linear", "logits", "embedding", "moe_linear")  # moe_linear: a linear inside a moe node
# plan method -> the weight format it rewrites to (int4-awq is int4 after fold_awq_scales)
REQUANT_METHODS = methods.REQUANTIZING


def is_float_weight_node(node: Node) -> bool:
    return node.op in WEIGHT_OPS and node.attrs.get("quant", "none") == "none"


def is_excluded(node: Node, patterns) -> bool:
    return any(fnmatchcase(node.name, p) for p in patterns)


def weight_nodes(graph: Graph) -> list:
    """The graph's linear/logits/embedding nodes, then the linears inside its moe nodes (builder/graph/experts.py: views
    with a linear node's interface, whose rewrites land in their moe node)."""
    return [n for n in graph.nodes if n.op in WEIGHT_OPS] + graph_expert_linears(graph)


def requant_targets(graph: Graph, plan) -> list[Node]:
    """Float linear/logits/embedding nodes the plan's requantization method rewrites (none for none/source), and
    the experts' projections of moe nodes (their routers and shared-expert gates stay float)."""
    if plan.quant.method not in REQUANT_METHODS:
        return []
    return [n for n in weight_nodes(graph) if is_float_weight_node(n) and not is_excluded(n, plan.quant.exclude)
            and not (n.op == "moe_linear" and n.base in FLOAT_LINEARS)]


def in_features(graph: Graph, node: Node) -> int:
    return graph.weights[node.inputs[1]].shape[1]


def check_divisible(graph: Graph, nodes: list[Node], divisor: int, what: str) -> None:
    """A one-line error naming the first node whose input size `divisor` does not divide."""
    for node in nodes:
        k = in_features(graph, node)
        if k % divisor:
            raise KilnError(f"{what} {divisor} does not divide the input size {k} of {node.name}; "
                            f"{_fix(graph, nodes, what)}")


def _fix(graph: Graph, nodes: list[Node], what: str) -> str:
    sizes = {in_features(graph, n) for n in nodes}
    fitting = [g for g in (32, 64, 128) if all(k % g == 0 for k in sizes)]
    if what.endswith("group_size") and fitting:
        return f"use --group-size {' or '.join(map(str, fitting))}"
    return "exclude the layer with [quant] exclude"


def quantize_node(graph: Graph, node: Node, quant: str, group_size: int | None,
                  make: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], float | None]],
                  cache: dict, memo: PartsMemo | None = None, measure: bool = True) -> None:
    """Replace the node's float weight by logical quantized operands made by `make(weight)` (in place).

    `cache` shares one quantized copy between nodes reading the same weight with the same scheme
    (a tied embedding and lm_head). Records the reconstruction error in graph.meta["quant_error"].
    With `memo` (a deterministic `make`: round to nearest) and lazy tensors, the operands are not kept: they are
    made again from the source weight whenever read (builder/sources/lazy_tensors.py), and this call makes them only for
    the error (`make` then takes measure=False: a format's quantize(..., measure=False), which skips it); without
    `measure` (a rank built alone, whose errors no measure reads) not even that: `make` runs on a meta tensor of the
    weight's shape, for its operands' shapes, and a weight is rounded only if its rank reads it.
    """
    weight = node.inputs[1]
    key = (weight, quant, group_size)
    if key not in cache:
        lazy = memo is not None and hasattr(graph.tensors, "derive_parts")
        if lazy and not measure:
            value = graph.weights[weight]
            parts, error = make(torch.empty(value.shape, device="meta"), measure=False)[0], None
        else:
            parts, error = make(graph.tensors[weight])
        base = weight.removesuffix(".weight")
        if f"{base}.qweight" in graph.weights:  # the same weight under another scheme already
            base = f"{base}.{quant}" + (f"g{group_size}" if group_size else "")
        names = {role: f"{base}.{role}" for role in FORMATS[quant].roles}
        for role, name in names.items():
            graph.add_weight(name, parts[role].contiguous())
        if lazy:
            graph.tensors.derive_parts(names, [weight], lambda w: {r: t.contiguous() for r, t in
                                                                   make(w, measure=False)[0].items()}, memo)
        cache[key] = (list(names.values()), error)
    names, error = cache[key]
    roles = node.attrs.get("operands", ["weight"])
    node.inputs = [node.inputs[0], *names, *node.inputs[2:]]
    node.attrs.update(quant=quant, group_size=group_size, layout="logical",
                      operands=[*FORMATS[quant].roles, *roles[1:]])
    if error is not None:
        graph.meta.setdefault("quant_error", {})[node.name] = round(error, 6)


def logical_operands(quant: str, quantized: Quantized) -> dict[str, torch.Tensor]:
    """Role -> tensor of a format's quantize() result (q, scales[, zeros])."""
    return dict(zip(FORMATS[quant].roles, quantized))


def requantize(graph: Graph, ctx, quant: str, group_size: int | None,
               quantize: Callable[..., Quantized]) -> Graph:
    """The body of quantize_int8/int4/fp8: rewrite every requantization target with the format's `quantize` (for
    a rank built alone, other than rank 0: only the weights its rank file reads, when it writes them)."""
    plan = ctx.plan
    out = graph.replace()
    nodes = requant_targets(out, plan)
    # The int8 and fp8 kernels read K in steps of 8; int4 needs whole groups.
    check_divisible(out, nodes, group_size or 8, "[quant] group_size" if group_size else "the kernels' step of")
    cache: dict = {}

    def make(weight: torch.Tensor, measure: bool = True) -> tuple[dict[str, torch.Tensor], float]:
        quantized = quantize(weight, measure=measure)
        return logical_operands(quant, quantized), quantized.error

    memo = PartsMemo()  # round to nearest gives the same codes every time: derive them, keep none
    for node in nodes:
        quantize_node(out, node, quant, group_size, make, cache, memo, measure=ctx.only_rank in (None, 0))
    out.drop_unused_weights()
    return out
