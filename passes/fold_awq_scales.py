"""Fold AWQ scales: per-input-channel scales searched on calibration text, folded into the preceding norm or linear.

For each set of float linears reading one activation x (q/k/v, gate/up, o, down; fused or not),
awq_search picks s = mean|x|^alpha minimising the INT4 output error; the linears' input columns
are multiplied by s and the producer of x divided by it, so the float function and the graph's
size are unchanged and quantize_int4 (next) rounds the scaled weights:
  rms_norm / add_rms_norm -> x   norm weight / s
  attention(q, k, v) -> x        v_proj rows / s (one scale per KV channel, shared by its query heads)
  silu_mul(gate, up) -> x        up_proj rows / s
Sets whose producer is anything else (or whose x feeds other ops) are left to plain INT4.

A mixture of experts (a moe node reading a norm's output) gets one set for the linears that read x: the router,
every expert's and the shared expert's gate and up projections, the shared expert's gate; the search weighs the
experts' gate and up projections on every token, and the scales fold into the norm (the router's columns are
scaled too: its logits are unchanged). Each expert's down projection then gets its own scales, searched on the
tokens the router sends it (their gated activations) and folded into that expert's up rows; an expert that
fewer than MIN_EXPERT_TOKENS calibration tokens reach keeps round to nearest (meta "awq_rtn_experts").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from builder.measure.calibration import LayerSweep, calibration_windows
from builder.graph.experts import MIN_EXPERT_TOKENS, expert_linears
from builder.graph.ir import Graph, Node
from builder.quant.awq import awq_search
from passes.context import PassContext
from passes.quant_rewrite import is_float_weight_node, requant_targets
from passes.rewrite import consumers
from runtime.ops import reference
from runtime.weights import int4



@dataclass
class ScaleSet:
    input: str                          # the activation x the linears share
    linears: list[Node]                 # every consumer of x (float linears); their columns are scaled
    searched: list[Node]                # those quantize_int4 will round (the search's objective)
    norm: Node | None = None            # fold into this norm's weight ...
    rows_of: Node | None = None         # ... or into these rows of this linear's weight (and bias)
    row_offset: int = 0
    channel_map: torch.Tensor | None = None  # x channel -> scale index (grouped-query o_proj)
    moe: Node | None = None             # a mixture whose experts' down projections get scales of their own after


def fold_awq_scales(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    targets = requant_targets(out, ctx.plan)
    sets = _scale_sets(out, {n.name for n in targets if n.op == "linear"})
    sets += _mixture_sets(out, {n.name for n in targets if n.op == "moe_linear"})
    if not sets:
        return out
    group_size = ctx.plan.quant.group_size
    alphas, rtn = {}, []
    searched = {n.name for n in targets}
    # A layer at a time: each set's x captured where its layer's stage computes it, then the scales searched and
    # folded (the float function unchanged, so later stages see what a whole-graph capture saw).
    sweep = LayerSweep(out, calibration_windows(ctx, "int4-awq"), "awq scales", ctx.show_progress)
    for stage in sweep:
        here = [s for s in sets if sweep.stage_of(s.input) == stage]
        activations = sweep.run({s.input for s in here}, advance=True)
        for scale_set in here:
            if any(out.weights[n.inputs[1]].shape[1] % group_size for n in scale_set.searched):
                continue  # quantize_int4 reports the group size that does not divide
            x = activations.pop(scale_set.input)
            weights = [out.tensors[n.inputs[1]] for n in scale_set.searched]
            found = awq_search(x, weights, lambda w: int4.fake_quantize(w, group_size),
                               channel_map=scale_set.channel_map)
            del weights
            if scale_set.moe is not None:  # the experts' down projections, on x before it is scaled
                rtn += _fold_expert_downs(out, scale_set.moe, x, group_size, alphas, searched)
            _fold(out, scale_set, found.scales)
            alphas.update((n.name, found.alpha) for n in scale_set.searched)
    out.meta["awq_alpha"] = alphas
    if rtn:
        out.meta["awq_rtn_experts"] = rtn
    return out


# ------------------------------------------------------------------------------------------ finding the sets

def _scale_sets(graph: Graph, searched: set[str]) -> list[ScaleSet]:
    users = consumers(graph)
    producer = {o: n for n in graph.nodes for o in n.outputs}
    sets = []
    for name, readers in users.items():
        targets = [n for n in readers if n.name in searched and n.inputs[0] == name]
        if not targets or name not in producer:
            continue
        if not all(is_float_weight_node(n) and n.op == "linear" and n.inputs[0] == name for n in readers):
            continue  # x feeds something besides float linears: scaling it would change that
        scale_set = ScaleSet(name, readers, targets)
        if _find_fold(graph, scale_set, producer[name], users, producer):
            touched = [w for n in readers for w in n.inputs[1:]]
            if all(len(users[w]) == 1 for w in touched):  # no shared weight changes under another node
                sets.append(scale_set)
    return sets


def _mixture_sets(graph: Graph, searched: set[str]) -> list[ScaleSet]:
    """One set a moe node whose input is a norm's output read by it alone: the linears that read x (its router, the
    experts' and shared expert's gate and up, the shared expert's gate), those of them quantize_int4 rounds
    searched, the scales folded into the norm."""
    users = consumers(graph)
    producer = {o: n for n in graph.nodes for o in n.outputs}
    sets = []
    for node in graph.nodes:
        x = node.inputs[0] if node.op == "moe" else None
        norm = producer.get(x)
        if (x is None or norm is None or norm.op not in ("rms_norm", "add_rms_norm") or norm.outputs[0] != x
                or [id(n) for n in users[x]] != [id(node)] or len(users[norm.inputs[-1]]) != 1):
            continue
        readers = [v for v in expert_linears(node) if not v.base.endswith("down_proj")]
        if not all(is_float_weight_node(v) and "bias" not in v.attrs["operands"] for v in readers):
            continue
        targets = [v for v in readers if v.name in searched]
        if targets:
            sets.append(ScaleSet(x, readers, targets, norm=norm, moe=node))
    return sets


def _fold_expert_downs(graph: Graph, node: Node, x: torch.Tensor, group_size: int, alphas: dict,
                       searched: set[str]) -> list[str]:
    """Scales of each expert's down projection, searched on the gated activations of the tokens routed to it and
    folded into its up rows (stacking by passes/fuse_gate_up.py comes later); the experts left to round to
    nearest (too few tokens), by name."""
    a = node.attrs
    views = {v.base: v for v in expert_linears(node)}
    tensor = lambda base: graph.tensors[views[base].inputs[1]].float()  # noqa: E731
    _, ids = reference.route(x.float() @ tensor("router").T, a["top_k"], a["norm_topk_prob"])
    skipped = []
    for e in a["experts"]:
        down, up = views[f"experts.{e}.down_proj"], views[f"experts.{e}.up_proj"]
        if down.name not in searched or not is_float_weight_node(up) or down.attrs["in_features"] % group_size:
            continue
        rows = (ids == e).any(dim=-1).nonzero().flatten()
        if rows.numel() < MIN_EXPERT_TOKENS:
            skipped.append(down.name)
            continue
        h = x.float()[rows]
        gate, up_rows = h @ tensor(f"experts.{e}.gate_proj").T, h @ tensor(f"experts.{e}.up_proj").T
        hidden = reference.gated_act(a["act"], gate, up_rows)
        found = awq_search(hidden, [tensor(f"experts.{e}.down_proj")], lambda w: int4.fake_quantize(w, group_size))
        _fold(graph, ScaleSet(down.name, [down], [down], rows_of=up), found.scales)
        alphas[down.name] = found.alpha
    return skipped


def _find_fold(graph: Graph, scale_set: ScaleSet, node: Node, users, producer) -> bool:
    x = scale_set.input
    if node.op in ("rms_norm", "add_rms_norm") and node.outputs[0] == x:
        scale_set.norm = node
        return len(users[node.inputs[-1]]) == 1
    if node.op == "silu_mul":
        if len(node.inputs) == 2:
            source = _rows_source(node.inputs[1], node, users, producer)
            width = 0
        else:
            source = _rows_source(node.inputs[0], node, users, producer)
            width = graph.values[x].shape[-1]  # up is the second half of gate_up
        if source is None:
            return False
        scale_set.rows_of, scale_set.row_offset = source[0], source[1] + width
        return True
    if node.op == "attention":
        source = _rows_source(node.inputs[2], node, users, producer)
        if source is None:
            return False
        a = node.attrs
        channels = torch.arange(a["num_heads"] * a["head_dim"])
        head, dim = channels // a["head_dim"], channels % a["head_dim"]
        scale_set.channel_map = head // (a["num_heads"] // a["num_kv_heads"]) * a["head_dim"] + dim
        scale_set.rows_of, scale_set.row_offset = source
        return True
    return False


def _rows_source(value: str, reader: Node, users, producer) -> tuple[Node, int] | None:
    """(float linear, first row) whose output rows are `value`, read only by `reader` (directly or via a split)."""
    if [id(n) for n in users[value]] != [id(reader)] or value not in producer:
        return None
    node, offset = producer[value], 0
    if node.op == "split":
        offset = sum(node.attrs["sizes"][: node.outputs.index(value)])
        source = node.inputs[0]
        if [id(n) for n in users[source]] != [id(node)] or source not in producer:
            return None
        node = producer[source]
    if node.op != "linear" or not is_float_weight_node(node):
        return None
    if any(len(users[w]) != 1 for w in node.inputs[1:]):
        return None
    return node, offset


# ------------------------------------------------------------------------------------------ folding

def _fold(graph: Graph, scale_set: ScaleSet, scales: torch.Tensor) -> None:
    """Scale the linears' input columns by s and divide the producer by s: each a weight derived from the one it
    replaces (computed when read in a streaming build, which then holds only the scales)."""
    full = scales if scale_set.channel_map is None else scales[scale_set.channel_map]

    def derive(name: str, fn) -> None:
        value = graph.weights[name]
        graph.derive_weight(name, value.dtype, value.shape, [name], fn)

    for node in scale_set.linears:
        derive(node.inputs[1], lambda w: w * full)
    if scale_set.norm is not None:
        derive(scale_set.norm.inputs[-1], lambda w: w / full)
        return
    node, start, count = scale_set.rows_of, scale_set.row_offset, scales.shape[0]
    roles = node.attrs.get("operands", ["weight"])
    for role, name in zip(roles, node.inputs[1:]):
        divisor = scales[:, None] if role == "weight" else scales
        derive(name, lambda w, d=divisor: _divide_rows(w, start, count, d))


def _divide_rows(tensor: torch.Tensor, start: int, count: int, divisor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[start:start + count] = tensor[start:start + count] / divisor
    return tensor
