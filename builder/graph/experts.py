"""The linears inside a moe node, seen one at a time as linear nodes by the passes that rewrite weights.

A moe node (builder/graph/ops.py) holds its router, every expert's gate/up/down projections and the shared expert's in
attrs["linears"]: one dict each with the attributes a linear node has (name, in_features, out_features, quant,
group_size, layout, operands), and its inputs are x followed by each linear's operands in that order. An
ExpertLinear is a live view of one of them with a linear node's interface (name, inputs, attrs): quantization
and packing rewrite it as they rewrite a linear node, and the writes land in the moe node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: ir checks a moe node through this module's views
    from builder.graph.ir import Graph, Node

# linears of a moe node kept in float by the requantization methods: the router (its rounding changes which
# experts a token reads) and the shared expert's gate (one row)
FLOAT_LINEARS = ("router", "shared_expert_gate")
# calibration tokens an expert needs for AWQ scales of its own (passes/fold_awq_scales.py); fewer: round to nearest
MIN_EXPERT_TOKENS = 32


class ExpertLinear:
    """The index-th linear of moe node `moe`, as a linear node (op "moe_linear"): writes to inputs and attrs are
    the moe node's."""

    op = "moe_linear"

    def __init__(self, moe: Node, index: int):
        self.moe, self.index = moe, index

    def __repr__(self) -> str:
        return f"ExpertLinear({self.name!r})"

    @property
    def base(self) -> str:
        return self.moe.attrs["linears"][self.index]["name"]

    @property
    def name(self) -> str:
        return f"{self.moe.name}.{self.base}"

    @property
    def layer(self) -> int | None:
        return self.moe.layer

    @property
    def outputs(self) -> list[str]:
        return []

    @property
    def attrs(self) -> dict:
        return self.moe.attrs["linears"][self.index]

    @attrs.setter
    def attrs(self, value: dict) -> None:
        self.moe.attrs["linears"][self.index] = value

    def _span(self) -> tuple[int, int]:
        linears = self.moe.attrs["linears"]
        start = 1 + sum(len(linear["operands"]) for linear in linears[:self.index])
        return start, start + len(linears[self.index]["operands"])

    @property
    def inputs(self) -> list[str]:
        start, end = self._span()
        return [self.moe.inputs[0], *self.moe.inputs[start:end]]

    @inputs.setter
    def inputs(self, value: list[str]) -> None:
        """[x, *operands]: replaces this linear's operands (those its attrs["operands"] name now)."""
        start, end = self._span()
        self.moe.inputs = [*self.moe.inputs[:start], *value[1:], *self.moe.inputs[end:]]


def expert_linears(node: Node) -> list[ExpertLinear]:
    """The linears of a moe node (none for another op)."""
    return [ExpertLinear(node, i) for i in range(len(node.attrs["linears"]))] if node.op == "moe" else []


def graph_expert_linears(graph: Graph) -> list[ExpertLinear]:
    """The linears of every moe node of the graph."""
    return [view for node in graph.nodes for view in expert_linears(node)]
