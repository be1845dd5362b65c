"""A rank's program (the IR as JSON) bound to its weights: a flat list of calls over named values.

The binding knows every op's kernel except the ones that depend on how the program is run:
`attention` (paged through the KV cache, or dense for a whole prompt), `gather_last`, and the
collectives. The runner supplies those through `Hooks`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime import kernels


@dataclass
class Hooks:
    attention: Callable[[dict], Callable]     # attrs -> fn(q, k, v) -> out
    gather_last: Callable[[torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor, dict], torch.Tensor] | None = None  # (x, attrs) -> sum over attrs["group"]
    all_gather: Callable[[torch.Tensor, dict], torch.Tensor] | None = None  # (x, attrs) -> concat of the group's pieces
    send: Callable[[torch.Tensor, dict], None] | None = None
    recv: Callable[[dict], torch.Tensor] | None = None


@dataclass
class Call:
    name: str
    fn: Callable
    inputs: list[str]   # activation inputs (weights are bound into fn)
    outputs: list[str]


class Program:
    def __init__(self, program: dict, tensors: dict[str, torch.Tensor], hooks: Hooks):
        self.doc = program
        self.weight_names = {w["name"] for w in program["weights"]}
        self.outputs = program["outputs"]
        self.calls = [self._bind(node, tensors, hooks) for node in program["nodes"]]

    @staticmethod
    def from_json(text: str, tensors: dict[str, torch.Tensor], hooks: Hooks) -> Program:
        return Program(json.loads(text), tensors, hooks)

    @property
    def attention_layers(self) -> list[dict]:
        return [n["attrs"] for n in self.doc["nodes"] if n["op"] == "attention"]

    def run(self, env: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        for call in self.calls:
            result = call.fn(*[env[i] for i in call.inputs])
            if len(call.outputs) == 1:
                env[call.outputs[0]] = result
            elif call.outputs:  # send has none
                env.update(zip(call.outputs, result))
        return [env[o] for o in self.outputs]

    def _bind(self, node: dict, tensors: dict, hooks: Hooks) -> Call:
        op, attrs, inputs = node["op"], node["attrs"], node["inputs"]
        acts = [i for i in inputs if i not in self.weight_names]
        weights = [tensors[i] for i in inputs if i in self.weight_names]
        if op in ("linear", "logits"):
            fn = kernels.make_linear(attrs, kernels.operands_of(inputs, attrs, tensors))
        elif op == "embedding":
            fn = kernels.make_embedding(attrs, kernels.operands_of(inputs, attrs, tensors))
        elif op == "rms_norm":
            weight, eps = weights[0], attrs["eps"]
            fn = lambda x: kernels.rms_norm(x, weight, eps)  # noqa: E731
        elif op == "add_rms_norm":
            weight, eps = weights[0], attrs["eps"]
            fn = lambda x, r: kernels.add_rms_norm(x, r, weight, eps)  # noqa: E731
        elif op == "split":
            sizes = attrs["sizes"]
            fn = lambda x: kernels.split(x, sizes)  # noqa: E731
        elif op == "rope":
            fn = kernels.make_rope(attrs)
        elif op == "attention":
            fn = hooks.attention(attrs)
        elif op == "silu_mul":
            fn = kernels.silu_mul
        elif op == "add":
            fn = torch.add
        elif op == "gather_last":
            fn = hooks.gather_last
        elif op in ("all_reduce", "all_gather"):
            collective = getattr(hooks, op)
            fn = collective and (lambda x: collective(x, attrs))
        elif op == "send":
            fn = lambda x: hooks.send(x, attrs)  # noqa: E731
        elif op == "recv":
            fn = lambda: hooks.recv(attrs)  # noqa: E731
        else:
            raise ValueError(f"program: op {op!r} of node {node['name']!r} has no kernel")
        if fn is None:
            raise ValueError(f"program: node {node['name']!r} ({op}) needs a multi-rank runner")
        return Call(node["name"], fn, acts, node["outputs"])
