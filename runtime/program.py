"""A rank's program (the IR as JSON) bound to its weights: a flat list of calls over named values.

The binding knows every op's kernel except the ones that depend on how the program is run:
`attention` (paged through the KV cache, or dense for a whole prompt), `gather_last`, and the
collectives. The runner supplies those through `Hooks`.

A runner that has a fused attention kernel (`Hooks.qkv_attention`) gets each layer's
`split -> rope -> attention` chain bound as one call over the fused projection and the positions,
when nothing else reads the chain's intermediate values; the IR itself stays op by op.

A call whose function is marked `recordable` is exactly one C kernel call; when every call is,
the executor can record a step on a tape and replay it (native_ops.Recording).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime import kernels, native_ops


@dataclass
class Hooks:
    attention: Callable[[dict], Callable]     # attrs -> fn(q, k, v) -> out
    gather_last: Callable[[torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor, dict], torch.Tensor] | None = None  # (x, attrs) -> sum over attrs["group"]
    all_gather: Callable[[torch.Tensor, dict], torch.Tensor] | None = None  # (x, attrs) -> concat of the group's pieces
    send: Callable[[torch.Tensor, dict], None] | None = None
    recv: Callable[[dict], torch.Tensor] | None = None
    # (rope attrs, attention attrs) -> fn(qkv, positions) -> out: split + rope + attention in one
    qkv_attention: Callable[[dict, dict], Callable] | None = None


@dataclass
class Call:
    name: str
    fn: Callable
    inputs: list[str]   # activation inputs (weights are bound into fn)
    outputs: list[str]

    @property
    def recordable(self) -> bool:
        """Each call is one C kernel call a step tape records (native_ops.Recording)."""
        return getattr(self.fn, "recordable", False)


class Program:
    def __init__(self, program: dict, tensors: dict[str, torch.Tensor], hooks: Hooks, reuse_outputs: bool = False):
        """reuse_outputs: nodes keep their output buffers from step to step (native_ops.Outputs), so a
        value is valid until its node runs again; for runners that consume each step's values within
        the step (the executor), never for callers that keep them (calibration)."""
        self.doc = program
        self.reuse_outputs = reuse_outputs
        self.weight_names = {w["name"] for w in program["weights"]}
        self.outputs = program["outputs"]
        nodes = program["nodes"]
        fused = self._fusible_attention(nodes) if hooks.qkv_attention else {}
        skipped = {i for chain in fused.values() for i in chain[:2]}
        self.calls = []
        for i, node in enumerate(nodes):
            if i in fused:
                split, rope, attention = (nodes[j] for j in fused[i])
                fn = hooks.qkv_attention(rope["attrs"], attention["attrs"])
                self.calls.append(Call(attention["name"], fn, [split["inputs"][0], rope["inputs"][2]],
                                       attention["outputs"]))
            elif i not in skipped:
                self.calls.append(self._bind(node, tensors, hooks))

    @property
    def recordable(self) -> bool:
        """Every call is recordable: a step tape replays the whole program."""
        return all(call.recordable for call in self.calls)

    @staticmethod
    def from_json(text: str, tensors: dict[str, torch.Tensor], hooks: Hooks, reuse_outputs: bool = False) -> Program:
        return Program(json.loads(text), tensors, hooks, reuse_outputs)

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

    def _fusible_attention(self, nodes: list[dict]) -> dict[int, tuple[int, int, int]]:
        """attention node index -> (split, rope, attention) indices of the chains qkv_attention can run."""
        readers: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            for name in node["inputs"]:
                readers.setdefault(name, []).append(i)
        outputs = set(self.outputs)
        chains = {}
        for i, node in enumerate(nodes):
            if node["op"] != "split" or len(node["outputs"]) != 3:
                continue
            q, k, v = node["outputs"]
            rope_at = readers.get(q, [])
            if len(rope_at) != 1 or nodes[rope_at[0]]["op"] != "rope" or readers.get(k) != rope_at:
                continue
            rope = nodes[rope_at[0]]
            attention_at = readers.get(v, [])
            if (rope["inputs"][:2] != [q, k] or len(attention_at) != 1
                    or nodes[attention_at[0]]["op"] != "attention"):
                continue
            attention = nodes[attention_at[0]]
            qr, kr = rope["outputs"]
            a, r = attention["attrs"], rope["attrs"]
            sizes = [a["num_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"],
                     a["num_kv_heads"] * a["head_dim"]]
            if (attention["inputs"] == [qr, kr, v] and readers.get(qr) == attention_at
                    and readers.get(kr) == attention_at and not {q, k, v, qr, kr} & outputs
                    and node["attrs"]["sizes"] == sizes and r["head_dim"] == a["head_dim"]
                    and (r["num_heads"], r["num_kv_heads"]) == (a["num_heads"], a["num_kv_heads"])):
                chains[attention_at[0]] = (i, rope_at[0], attention_at[0])
        return chains

    def _bind(self, node: dict, tensors: dict, hooks: Hooks) -> Call:
        op, attrs, inputs = node["op"], node["attrs"], node["inputs"]
        reuse = self.reuse_outputs and not set(node["outputs"]) & set(self.outputs)
        acts = [i for i in inputs if i not in self.weight_names]
        weights = [tensors[i] for i in inputs if i in self.weight_names]
        if op in ("linear", "logits"):
            fn = kernels.make_linear(attrs, kernels.operands_of(inputs, attrs, tensors), reuse)
        elif op == "embedding":
            fn = kernels.make_embedding(attrs, kernels.operands_of(inputs, attrs, tensors))
        elif op == "rms_norm":
            fn = native_ops.bind_rms_norm(weights[0].float().contiguous(), attrs["eps"], reuse)
        elif op == "add_rms_norm":
            fn = native_ops.bind_add_rms_norm(weights[0].float().contiguous(), attrs["eps"], reuse)
        elif op == "split":
            sizes = attrs["sizes"]
            fn = lambda x: kernels.split(x, sizes)  # noqa: E731
        elif op == "rope":
            fn = kernels.make_rope(attrs)
        elif op == "attention":
            fn = hooks.attention(attrs)
        elif op == "silu_mul":
            width = node["types"][0]["shape"][-1]
            fn = native_ops.bind_silu_mul(width, reuse) if len(acts) == 1 else kernels.silu_mul
        elif op == "add":
            fn = native_ops.bind_add(reuse)
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
