"""A rank's program (the IR as JSON) bound to its weights: a flat list of calls over named values.

The binding knows every op's kernel except the ones that depend on how the program is run:
`attention` (paged through the KV cache, or dense for a whole prompt), `gather_last`, and the
collectives. The runner supplies those through `Hooks`.

A runner that has a fused attention kernel (`Hooks.qkv_attention`) gets each layer's
`split -> rope -> attention` chain (`split -> head_rms_norm of q and of k -> rope -> attention` with
Gemma 3's q/k norms) bound as one call over the fused projection and the positions, when nothing
else reads the chain's intermediate values; the IR itself stays op by op. Where q, k and v come from
three linears (weights of different formats, which fuse_qkv leaves apart), the chain without the split
is bound the same way over the three projections.

A call whose function is marked `recordable` does all its work in C kernel calls; when every call
does, the executor can record a step on a tape and replay it (runtime.ops.tape.Recording).

`Program.run` is the one runner of a program: the executor (paged attention through its KV cache),
the builder's reference interpreter and calibration (dense attention) differ only by their hooks,
and calibration watches the run through an observer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.ops import linear, moe, reference, rowops
from runtime.ops.tape import REUSE_ROWS, Outputs, Slot, made_by, recordable, unrecorded
from runtime.weights import fp8


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
    # (rope attrs, attention attrs, q/k norms) -> fn(qkv, positions) -> out: split (+ q/k norms) + rope +
    # attention in one; the norms are None or (q weight [hd], k weight [hd], eps) of head_rms_norm
    qkv_attention: Callable[[dict, dict, tuple | None], Callable] | None = None


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
        """Each call does all its work in C kernel calls a step tape records (runtime.ops.tape.Recording)."""
        return getattr(self.fn, "recordable", False)


# (call index, call, env after the call) -> True to end the run there
Observer = Callable[[int, Call, dict], bool]


class Program:
    def __init__(self, program: dict, tensors: dict[str, torch.Tensor], hooks: Hooks, reuse_outputs: bool = False,
                 binders: dict | None = None, reuse_final: bool = False):
        """binders: op -> binder, for a runner with kernels of its own (the cuda backend); default BINDERS.

        reuse_outputs: nodes keep their output buffers from step to step (runtime.ops.tape.Outputs), so a
        value is valid until its node runs again; for runners that consume each step's values within
        the step (the executor), never for callers that keep them (calibration). reuse_final: the
        program's outputs too (a runner whose callers are done with them before its next step)."""
        self.doc = program
        self.reuse_outputs, self.reuse_final = reuse_outputs, reuse_outputs and reuse_final
        self.binders = binders or BINDERS
        self.weight_names = {w["name"] for w in program["weights"]}
        self.outputs = program["outputs"]
        nodes = program["nodes"]
        fused = self._fusible_attention(nodes) if hooks.qkv_attention else {}
        skipped = {i for chain in fused.values() for i in chain[:-1]}
        self.calls = []
        self._unchecked = False
        made: list[list[Outputs]] = []  # per call: the kept-output buffers its binder made
        for i, node in enumerate(nodes):
            if i in skipped:
                continue
            with made_by() as outputs:
                if i in fused:
                    self.calls.append(self._bind_chain([nodes[j] for j in fused[i]], tensors, hooks))
                else:
                    self.calls.append(self._bind(node, tensors, hooks))
            made.append(outputs)
        self.shared: list[tuple[str, Slot]] = self._share_buffers(made) if reuse_outputs else []
        self.done = self._done_after()
        made_at = {name: i for i, call in enumerate(self.calls) for name in call.outputs}
        self.shared_by_call: list[list[tuple[str, Slot]]] = [[] for _ in self.calls]  # each call's shared outputs
        for name, slot in self.shared:
            self.shared_by_call[made_at[name]].append((name, slot))

    def _last_reads(self) -> dict[str, int]:
        """Each value a call reads -> the index of the last call that reads it."""
        return {name: i for i, call in enumerate(self.calls) for name in call.inputs}

    def _done_after(self) -> list[tuple[str, ...]]:
        """Per call: the values no later call reads (its inputs read for the last time, its outputs never
        read), the program's outputs excepted: what `run(release=True)` drops after the call."""
        last = {name: i for i, call in enumerate(self.calls) for name in call.outputs}  # never read: done where made
        last.update(self._last_reads())
        done: list[list[str]] = [[] for _ in self.calls]
        for name, at in last.items():
            if name not in self.outputs:
                done[at].append(name)
        return [tuple(names) for names in done]

    @property
    def recordable(self) -> bool:
        """Every call is recordable: a step tape replays the whole program."""
        return all(call.recordable for call in self.calls)

    @staticmethod
    def from_json(text: str, tensors: dict[str, torch.Tensor], hooks: Hooks, reuse_outputs: bool = False) -> Program:
        return Program(json.loads(text), tensors, hooks, reuse_outputs)

    def _share_buffers(self, made: list[list[Outputs]]) -> list[tuple[str, Slot]]:
        """Gives the kept outputs of values that are never alive at once one buffer between them (tape.Slot),
        from the calls' order: a value lives from the call that makes it to the last call that reads it. A
        call whose binder made no Outputs of its own (or several) may return views of its inputs, so its
        outputs count as its inputs for as long as they live. Returns (value, slot) of every shared value."""
        last_use = self._last_reads()
        last_use.update((name, len(self.calls)) for name in self.outputs)  # read after the run
        holder: dict[str, str] = {}  # value -> the value whose buffer holds it

        def root(name: str) -> str:
            while holder.get(name, name) != name:
                name = holder[name]
            return name

        own = [len(outs) == 1 and len(outs[0].widths) == len(call.outputs) for call, outs in zip(self.calls, made)]
        for call, mine in zip(self.calls, own):
            for name in call.outputs:
                holder[name] = name
            if not mine:  # its outputs may be its inputs' storage: the inputs live while the outputs do
                for name in call.inputs:
                    if name in holder:
                        for out in call.outputs:
                            holder[root(out)] = root(name)
        ends: dict[str, int] = {}
        for name, at in last_use.items():
            if name in holder:
                r = root(name)
                ends[r] = max(ends.get(r, -1), at)
        free: list[Slot] = []
        busy: list[tuple[int, Slot]] = []
        shared = []
        for i, (call, mine) in enumerate(zip(self.calls, own)):
            for end, slot in [b for b in busy if b[0] < i]:  # read for the last time before this call
                busy.remove((end, slot))
                free.append(slot)
            if not mine:
                continue
            slots = []
            for name, width in zip(call.outputs, made[i][0].widths):
                fits = [slot for slot in free if slot.width >= width]
                slot = (min(fits, key=lambda s: s.width) if fits else max(free, key=lambda s: s.width) if free
                        else Slot())
                if slot in free:
                    free.remove(slot)
                slot.width = max(slot.width, width)
                busy.append((ends.get(root(name), i), slot))
                slots.append(slot)
                shared.append((name, slot))
            made[i][0].slots = tuple(slots)
        self._unchecked = bool(shared)
        return shared

    def _check_shared(self, env: dict[str, torch.Tensor], shared: list[tuple[str, Slot]] | None = None) -> bool:
        """After the first run on kept buffers: every shared value is where its slot is (a binder that returned
        something else would have had its value overwritten by a later node's). shared: those values only (a
        releasing run checks each call's own before they leave env); True if any value could be checked."""
        checked = False
        for name, slot in self.shared if shared is None else shared:
            value = env.get(name)
            if (slot.buffer is None or value is None or value.dim() != 2 or value.numel() == 0
                    or value.shape[0] > REUSE_ROWS):
                continue
            if value.data_ptr() != slot.buffer.data_ptr():
                raise RuntimeError(f"program: value {name!r} is not in the buffer its node was given (runtime.ops."
                                   "tape.Outputs): its binder must return its Outputs' buffers, in order")
            checked = True
        if shared is None:
            self._unchecked = not checked
        return checked

    def run(self, env: dict[str, torch.Tensor], observer: Observer | None = None,
            release: bool = False) -> list[torch.Tensor] | None:
        """Every call in order over env (value name -> tensor, holding the inputs); the program's outputs.

        An observer sees env after each call and may end the run there (None is returned then); without
        one the loop does nothing else, which keeps the executor's per-step cost one Python call per op.
        release (no observer): each value leaves env after the last call that reads it, so a run holds
        the values alive at once, not all of them (a 512-token SmolLM2 step: 650 MB of activations kept
        to its end otherwise); env keeps the inputs no call reads and the outputs.
        """
        if observer is None and release:
            checking, checked = self._unchecked, False
            for call, done, shared in zip(self.calls, self.done, self.shared_by_call):
                result = call.fn(*[env[i] for i in call.inputs])
                if len(call.outputs) == 1:
                    env[call.outputs[0]] = result
                elif call.outputs:
                    env.update(zip(call.outputs, result))
                if checking and shared:
                    checked = self._check_shared(env, shared) or checked
                for name in done:
                    del env[name]
            if checking:
                self._unchecked = not checked
            return [env[o] for o in self.outputs]
        if observer is None:
            for call in self.calls:
                result = call.fn(*[env[i] for i in call.inputs])
                if len(call.outputs) == 1:
                    env[call.outputs[0]] = result
                elif call.outputs:  # send has none
                    env.update(zip(call.outputs, result))
            if self._unchecked:
                self._check_shared(env)
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

    def _fusible_attention(self, nodes: list[dict]) -> dict[int, list[int]]:
        """attention node index -> the node indices of a chain qkv_attention can run: the split of a fused
        projection (absent when q, k and v are projections of their own), the head_rms_norms of q and of k
        where the model has them, rope, attention."""
        readers: dict[str, list[int]] = {}
        producer: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for name in node["inputs"]:
                readers.setdefault(name, []).append(i)
            producer.update((name, i) for name in node["outputs"])

        def made_for(name: str, op: str, reader: int) -> int | None:
            """The `op` node that makes `name`, when `reader` alone reads it."""
            at = producer.get(name)
            return at if at is not None and nodes[at]["op"] == op and readers.get(name) == [reader] else None

        outputs = set(self.outputs)
        chains = {}
        for at, attention in enumerate(nodes):
            if attention["op"] != "attention":
                continue
            qr, kr, v = attention["inputs"]
            rope_at = made_for(qr, "rope", at)
            if rope_at is None or made_for(kr, "rope", at) != rope_at or nodes[rope_at]["outputs"] != [qr, kr]:
                continue
            rope = nodes[rope_at]
            qn, kn = rope["inputs"][:2]
            norms = self._head_norms(nodes, [made_for(qn, "head_rms_norm", rope_at),
                                             made_for(kn, "head_rms_norm", rope_at)])
            if norms is None:
                continue
            q, k = [nodes[j]["inputs"][0] for j in norms] or [qn, kn]
            a, r = attention["attrs"], rope["attrs"]
            if ({q, k, v, qn, kn, qr, kr} & outputs or r["head_dim"] != a["head_dim"]
                    or (r["num_heads"], r["num_kv_heads"]) != (a["num_heads"], a["num_kv_heads"])
                    or any(nodes[j]["attrs"]["head_dim"] != a["head_dim"] for j in norms)):
                continue
            split = producer.get(q)
            sizes = [a["num_heads"] * a["head_dim"]] + [a["num_kv_heads"] * a["head_dim"]] * 2
            if (split is not None and nodes[split]["op"] == "split" and nodes[split]["outputs"] == [q, k, v]
                    and nodes[split]["attrs"]["sizes"] == sizes and readers.get(q) == [norms[0] if norms else rope_at]
                    and readers.get(k) == [norms[1] if norms else rope_at] and readers.get(v) == [at]):
                chains[at] = [split, *norms, rope_at, at]
            elif all(nodes[producer[x]]["op"] == "linear" for x in (q, k, v) if x in producer):
                # q, k and v from projections of their own (whose weights the compiler could not fuse: their
                # formats differ); a linear's output is a contiguous [T, width] the kernel reads by rows
                chains[at] = [*norms, rope_at, at]
        return chains

    def _head_norms(self, nodes: list[dict], at: list[int | None]) -> list[int] | None:
        """at: the head_rms_norm nodes whose outputs alone feed the rope, if any. [] when neither q nor k is
        normalized, both when the kernel can run them (one eps, a weight each), None when it cannot."""
        if at == [None, None]:
            return []
        if None in at:
            return None
        q_norm, k_norm = nodes[at[0]], nodes[at[1]]
        fusible = (q_norm["attrs"]["eps"] == k_norm["attrs"]["eps"]
                   and all(len(n["inputs"]) == 2 and n["inputs"][1] in self.weight_names for n in (q_norm, k_norm)))
        return at if fusible else None

    def _bind_chain(self, chain: list[dict], tensors: dict, hooks: Hooks) -> Call:
        """One call of hooks.qkv_attention over the fused projection (or q, k and v) and the positions."""
        *head, rope, attention = chain
        split = head[0] if head and head[0]["op"] == "split" else None
        norms = head[1:] if split else head
        weights = [tensors[n["inputs"][1]].float().contiguous() for n in norms]
        qk_norm = (*weights, norms[0]["attrs"]["eps"]) if norms else None
        fn = hooks.qkv_attention(rope["attrs"], attention["attrs"], qk_norm)
        if split:
            sources = [split["inputs"][0]]
        else:
            sources = [n["inputs"][0] for n in norms] or rope["inputs"][:2]
            sources = [*sources, attention["inputs"][2]]
        return Call(attention["name"], fn, [*sources, rope["inputs"][2]], attention["outputs"])

    def _bind(self, node: dict, tensors: dict, hooks: Hooks) -> Call:
        if node["op"] not in self.binders:
            raise ValueError(f"program: op {node['op']!r} of node {node['name']!r} has no kernel")
        inputs = node["inputs"]
        site = Site(node, node["attrs"], [tensors[i] for i in inputs if i in self.weight_names], tensors, hooks,
                    self.reuse_outputs and (self.reuse_final or not set(node["outputs"]) & set(self.outputs)))
        fn = self.binders[node["op"]](site)
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
    run = linear.bind_linear(site.attrs, site.operands(), site.reuse)
    scale = site.attrs.get("act_scale")
    if scale is None:
        return run
    # FP8 activations (a tensorrt fp8 plan: passes/calibrate_fp8_activations.py): the input as the engine's
    # FP8 GEMM reads it, so the build's accuracy measures and verification see what the GPU computes.
    return lambda x: run(fp8.fake_quantize(x, scale))


def _silu_mul(site: Site):
    act = site.attrs.get("act", "silu")
    if len(site.node["inputs"]) == 1:  # the fused gate | up projection
        return rowops.bind_silu_mul(site.node["types"][0]["shape"][-1], site.reuse, act)
    return lambda *xs: reference.gated_act(act, *xs)


def _rms_norm(site: Site):
    norm = rowops.bind_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"], site.reuse)

    def run(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():  # OLMoE's q and k norms read a split of the fused projection
            unrecorded()  # the copy would not outlive the call: a tape cannot replay it
            x = x.contiguous()
        return norm(x)

    return recordable(run)


def _head_rms_norm(site: Site):
    """The rms_norm kernel over rows of one head each ([T, heads * hd] viewed as [T * heads, hd])."""
    hd = site.attrs["head_dim"]
    norm = rowops.bind_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"], False)
    return lambda x: norm(x.contiguous().view(-1, hd)).view(x.shape)


def _embedding(site: Site):
    rows, scale = linear.bind_embedding(site.attrs, site.operands(), site.reuse), site.attrs.get("scale", 1.0)
    if scale == 1.0:
        return rows
    scale_rows = rowops.bind_scale(scale)  # in place: rows' output is this node's own

    def scaled(tokens: torch.Tensor) -> torch.Tensor:
        return scale_rows(rows(tokens))

    scaled.recordable = getattr(rows, "recordable", False)  # packed rows: both calls are C kernels
    return scaled


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
    "rms_norm": _rms_norm,
    "add_rms_norm": lambda site: rowops.bind_add_rms_norm(site.weights[0].float().contiguous(), site.attrs["eps"],
                                                          site.reuse),
    "head_rms_norm": _head_rms_norm,
    "split": _split,
    "rope": lambda site: reference.make_rope(site.attrs),
    "attention": lambda site: site.hooks.attention(site.attrs),
    "silu_mul": _silu_mul,
    "moe": lambda site: moe.bind_moe(site.node, site.tensors),
    "add": lambda site: rowops.bind_add(site.reuse),
    "gather_last": lambda site: site.hooks.gather_last,
    "all_reduce": _collective("all_reduce"),
    "all_gather": _collective("all_gather"),
    "send": _send,
    "recv": _recv,
}
