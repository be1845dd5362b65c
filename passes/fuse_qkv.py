"""Fuse q/k/v: the three projections of one attention block become one linear and a split."""

from __future__ import annotations

from builder.graph.ir import Graph, Node
from passes.context import PassContext
from passes.rewrite import can_concat, concat_linears, consumers


def fuse_qkv(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    users = consumers(out)
    nodes: list[Node] = []
    fused: set[str] = set()
    for node in out.nodes:
        if node.name in fused:
            continue
        group = _qkv_group(node, users)
        if group is None:
            nodes.append(node)
            continue
        prefix = node.name.rsplit(".", 1)[0]
        linear = concat_linears(out, group, f"{prefix}.qkv_proj")
        split = Node(f"{prefix}.qkv_split", "split", [linear.outputs[0]], [n.outputs[0] for n in group],
                     {"sizes": [n.attrs["out_features"] for n in group]}, node.layer)
        nodes += [linear, split]
        fused.update(n.name for n in group)
    out.nodes = nodes  # the fused linear stands where q_proj stood, after its input, before q/k/v's users
    out.drop_unused_weights()
    return out


def _qkv_group(node: Node, users) -> list[Node] | None:
    """The q, k, v linears reading this q_proj's input, when `node` is a q_proj that can fuse."""
    if node.op != "linear" or not node.name.endswith(".q_proj"):
        return None
    prefix = node.name[: -len("q_proj")]
    by_name = {n.name: n for n in users[node.inputs[0]]}
    group = [by_name.get(prefix + p) for p in ("q_proj", "k_proj", "v_proj")]
    return group if all(group) and can_concat(group) else None

