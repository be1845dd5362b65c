"""A rank's program (the IR as JSON) bound to its weights: a flat list of calls over named values.

The binding knows every op's kernel except the ones that depend on how the program is run:
`attention` (paged through the KV cache, or dense for a whole prompt), `gather_last`, and the
collectives. The runner supplies those through `Hooks`.

A runner that has a fused attention kernel (`Hooks.qkv_attention`) gets each layer's
`split -> rope -> attention` chain bound as one call over the fused projection and the positions,
when nothing else reads the chain's intermediate values; the IR itself stays op by op.

A call whose function is marked `recordable` is exactly one C kernel call; when every call is,
the executor can record a step on a tape and replay it (runtime.ops.tape.Recording).

`Program.run` is the one runner of a program: the executor (paged attention through its KV cache),
the builder's reference interpreter and calibration (dense attention) differ only by their hooks,
and calibration watches the run through an observer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.ops import linear, reference, rowops


def attention_layers(program: dict) -> list[dict]:
    """The attrs of every attention node of a program (the layers a KV cache holds), in order."""
    return [n["attrs"] for n in program["nodes"] if n["op"] == "attention"]


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


def dense_hooks(attention: Callable[[dict], Callable] | None = None, all_logits: bool = False) -> Hooks:
    """Hooks of a single-rank run over whole sequences with no cache: dense causal attention (or
    `attention`), and every position's logits with all_logits, else the last one's."""
    dense = attention or (lambda attrs: lambda q, k, v: reference.dense_causal_attention(q, k, v, attrs))
    return Hooks(dense, (lambda x: x) if all_logits else (lambda x: x[-1:]))


@dataclass
class Call:
    name: str
    fn: Callable
    inputs: list[str]   # activation inputs (weights are bound into fn)
    outputs: list[str]

    @property
    def recordable(self) -> bool:
        """Each call is one C kernel call a step tape records (runtime.ops.tape.Recording)."""
        return getattr(self.fn, "recordable", False)


# (call index, call, env after the call) -> True to end the run there
Observer = Callable[[int, Call, dict], bool]


class Program:
    def __init__(self, program: dict, tensors: dict[str, torch.Tensor], hooks: Hooks, reuse_outputs: bool = False):
        """reuse_outputs: nodes keep their output buffers from step to step (runtime.ops.tape.Outputs), so a
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

    def run(self, env: dict[str, torch.Tensor], observer: Observer | None = None) -> list[torch.Tensor] | None:
        """Every call in order over env (value name -> tensor, holding the inputs); the program's outputs.

        An observer sees env after each call and may end the run there (None is returned then); without
        one the loop does nothing else, which keeps the executor's per-step cost one Python call per op.
        """
        if observer is None:
            for call in self.calls:
                result = call.fn(*[env[i] for i in call.inputs])
                if len(call.outputs) == 1:
                    env[call.outputs[0]] = result
                elif call.outputs:  # send has none
                    env.update(zip(call.outputs, result))
            return [env[o] for o in self.outputs]
        for index, call in enumerate(self.calls):
            result = call.fn(*[env[i] for i in call.inputs])
            if len(call.outputs) == 1:
                env[call.outputs[0]] = result
            elif call.outputs:
                env.update(zip(call.outputs, result))
            if observer(index, call, env):
                return None
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
        if node["op"] not in BINDERS:
            raise ValueError(f"program: op {node['op']!r} of node {node['name']!r} has no kernel")
        inputs = node["inputs"]
        site = Site(node, node["attrs"], [tensors[i] for i in inputs if i in self.weight_names], tensors, hooks,
                    self.reuse_outputs and not set(node["outputs"]) & set(self.outputs))
        fn = BINDERS[node["op"]](site)
        if fn is None:
            raise ValueError(f"program: node {node['name']!r} ({node['op']}) needs a multi-rank runner")
        return Call(node["name"], fn, [i for i in inputs if i not in self.weight_names], node["outputs"])


# ---------------------------------------------------------------------------------------- binders

@dataclass(frozen=True)
class Site:
    """What a binder sees of one node: its weights are bound into the callable it returns."""

    node: dict
    attrs: dict
    weights: list[torch.Tensor]          # the node's weight inputs, in order
    tensors: dict[str, torch.Tensor]     # every weight of the program, by name
    hooks: Hooks
    reuse: bool                          # the node may keep its output buffers (runtime.ops.tape.Outputs)

    def operands(self) -> dict[str, torch.Tensor]:
        return linear.operands_of(self.node["inputs"], self.attrs, self.tensors)


def _linear(site: Site):
    return linear.bind_linear(site.attrs, site.operands(), site.reuse)


def _silu_mul(site: Site):
    act = site.attrs.get("act", "silu")
    if act != "silu":  # Gemma's gelu-tanh gate: torch's kernel
        return lambda *xs: reference.gated_act(act, *xs)
    if len(site.node["inputs"]) == 1:  # the fused gate | up projection
        return rowops.bind_silu_mul(site.node["types"][0]["shape"][-1], site.reuse)
    return reference.silu_mul


def _head_rms_norm(site: Site):
    """The rms_norm kernel over rows of one head each ([T, heads * hd] viewed as [T * heads, hd])."""
    hd = site.attrs["head_dim"]
    norm = rowops.bind_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"], False)
    return lambda x: norm(x.contiguous().view(-1, hd)).view(x.shape)


def _embedding(site: Site):
    rows, scale = linear.bind_embedding(site.attrs, site.operands()), site.attrs.get("scale", 1.0)
    return rows if scale == 1.0 else (lambda tokens: rows(tokens) * scale)


def _split(site: Site):
    sizes = site.attrs["sizes"]
    return lambda x: reference.split(x, sizes)


def _collective(op: str):
    def bind(site: Site):
        collective = getattr(site.hooks, op)
        return collective and (lambda x: collective(x, site.attrs))

    return bind


def _send(site: Site):
    return lambda x: site.hooks.send(x, site.attrs)


def _recv(site: Site):
    return lambda: site.hooks.recv(site.attrs)


# op -> binder: (site) -> the node's callable over its activation inputs (None: the runner lacks the hook)
BINDERS: dict[str, Callable[[Site], Callable | None]] = {
    "linear": _linear,
    "logits": _linear,
    "embedding": _embedding,
    "rms_norm": lambda site: rowops.bind_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"],
                                                  site.reuse),
    "add_rms_norm": lambda site: rowops.bind_add_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"],
                                                          site.reuse),
    "head_rms_norm": _head_rms_norm,
    "split": _split,
    "rope": lambda site: reference.make_rope(site.attrs),
    "attention": lambda site: site.hooks.attention(site.attrs),
    "silu_mul": _silu_mul,
    "add": lambda site: rowops.bind_add(site.reuse),
    "gather_last": lambda site: site.hooks.gather_last,
    "all_reduce": _collective("all_reduce"),
    "all_gather": _collective("all_gather"),
    "send": _send,
    "recv": _recv,
}
