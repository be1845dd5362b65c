"""The cpu kernel of a moe node: routing, then each routed expert's gated MLP over the tokens routed to it.

The router, the experts' projections and the shared expert's are bound as linear nodes are (runtime/ops/linear.py:
float, or packed int4/int8/fp8/... read by the C kernels), so a step reads only the weights of the experts its
tokens chose, each once (runtime.ops.reference.moe groups the tokens by expert). A moe call is not recorded on a
step tape: which experts run changes from step to step.
"""

from __future__ import annotations

import torch

from runtime.ops import linear, reference, rowops


def operands_by_linear(node: dict, tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """A moe node of a program -> {linear name: {role: tensor}}: its inputs after x are each linear's operands,
    in attrs["linears"] order."""
    out, at = {}, 1
    for entry in node["attrs"]["linears"]:
        roles = entry["operands"]
        out[entry["name"]] = {role: tensors[name] for role, name in zip(roles, node["inputs"][at:at + len(roles)])}
        at += len(roles)
    return out


def held_linears(attrs: dict) -> list[dict]:
    """The linears a moe node computes with: the router, the experts it holds (attrs["experts"]) and the shared
    expert's."""
    held = {f"experts.{e}." for e in attrs["experts"]}
    return [entry for entry in attrs["linears"]
            if not entry["name"].startswith("experts.") or entry["name"][:entry["name"].index(".", 8) + 1] in held]


class ExpertReads:
    """Bytes of expert weights the cpu kernel has read in this process (each routed expert's, once a step): what
    `engine-run bench` counts a mixture's steps as reading."""

    bytes = 0


def bind_moe(node: dict, tensors: dict, bind_linear=None, act=None):
    """x [T, H] -> [T, H] for a moe node; bind_linear(linear attrs, operands) -> callable (default: the cpu
    kernels'), act(gate, up) -> the gated activation (default: the node's reference)."""
    attrs = node["attrs"]
    bind_linear = bind_linear or linear.bind_linear
    operands = operands_by_linear(node, tensors)
    bound = {entry["name"]: bind_linear(entry, operands[entry["name"]]) for entry in held_linears(attrs)}
    if act is None:
        def act(*xs: torch.Tensor) -> torch.Tensor:  # stacked gate | up: the C kernel
            if len(xs) == 1 and xs[0].dtype == torch.float32 and xs[0].is_contiguous():
                return rowops.silu_mul(xs[0], attrs["act"])
            return reference.gated_act(attrs["act"], *xs)
    sizes = {e: sum(t.nbytes for name, ops in operands.items() if name.startswith(f"experts.{e}.")
                    for t in ops.values()) for e in attrs["experts"]}

    def ran(e: int) -> None:
        ExpertReads.bytes += sizes[e]

    return lambda x: reference.moe(x, lambda name, h: bound[name](h), attrs, act, ran)
