"""Shard tensor parallel: keep this rank's heads, MLP columns and vocabulary rows; collectives where shares meet.

A moe node, with ep > 1 (the plan's expert parallelism: the stage's ranks are max(tp, ep)), keeps whole experts:
rank r holds experts [r * E // ranks, (r + 1) * E // ranks) (uneven counts allowed), every rank routes every
token with the whole router, rank 0 alone runs the shared expert. With ep = 1 every expert (and the shared one) is
split by its intermediate columns, as a dense MLP. Either way an all_reduce sums the ranks' partial outputs, as
after a row split. With tp = 1 beside ep > 1 nothing else is split: attention runs whole on every rank.

Column split (output rows of the weight): q/k/v (by heads), gate/up (by intermediate columns), the
embedding and logits (by vocabulary rows). Row split (input columns of the weight): o and down,
followed by an all_reduce of the partial sums; their bias is added on tp rank 0 only. The embedding
gives zeros outside its rows and is all_reduced; the logits' pieces are all_gathered. Fused linears
(q/k/v + split, gate/up + one-input silu_mul) keep each part's rows. Quantized operands in the logical
layout are sliced along the same axes; group-wise scales need shares aligned to the group size.
"""

from __future__ import annotations

import torch

from builder.errors import KilnError
from builder.graph.experts import expert_linears
from builder.graph.ir import Graph, Node, Value
from builder.sources.lazy_tensors import LazyTensors
from passes.context import PassContext
from passes.rewrite import consumers
from runtime.format.mapping import HeadShare, Mapping, Span
from runtime.ops.moe import held_linears


def shard_tensor_parallel(graph: Graph, ctx: PassContext) -> Graph:
    plan = ctx.plan
    mapping = Mapping(plan.group, plan.pp, ctx.rank)
    cfg = graph.meta["model"]
    if plan.ep > 1 and not any(n.op == "moe" for n in graph.nodes):
        raise KilnError(f"shard_tensor_parallel: ep={plan.ep}, but the model has no mixture of experts to split")
    try:  # tp = 1 beside ep > 1: attention, the dense MLPs and the vocabulary stay whole on every rank
        tensors = mapping if plan.tp > 1 else Mapping()
        heads = tensors.attention_heads(cfg["num_heads"], cfg["num_kv_heads"])
        mlp = tensors.columns(cfg["intermediate_size"], "intermediate_size")
        vocab = tensors.columns(cfg["vocab_size"], "vocab_size")
    except ValueError as exc:
        raise KilnError(f"shard_tensor_parallel: {exc}") from None
    out = graph.replace(tensors=LazyTensors.of(graph.tensors))
    out.meta["mapping"] = mapping.to_dict()
    out.meta["shard"] = {"tp_rank": mapping.tp_rank,
                         "q_heads": [heads.q.start, heads.q.count], "kv_heads": [heads.kv.start, heads.kv.count],
                         "intermediate": [mlp.start, mlp.count], "vocab": [vocab.start, vocab.count]}
    if mapping.tp > 1:
        _Sharder(out, mapping, heads, mlp, vocab, plan.tp > 1, plan.ep > 1).run()
    return out


class _Sharder:
    def __init__(self, graph: Graph, mapping: Mapping, heads: HeadShare, mlp: Span, vocab: Span,
                 tensor_parallel: bool = True, expert_parallel: bool = False):
        """tensor_parallel: split attention, MLPs and the vocabulary (else only a mixture's experts are split);
        expert_parallel: a mixture's whole experts go to the ranks (else each expert is split by its columns)."""
        self.g, self.mapping, self.heads, self.mlp, self.vocab = graph, mapping, heads, mlp, vocab
        self.tensor_parallel, self.expert_parallel = tensor_parallel, expert_parallel
        self.defined_by = {o: n for n in graph.nodes for o in n.outputs}
        self.users = consumers(graph)
        self.kept: dict[str, list[Span]] = {}     # value -> its columns this rank computes
        self.sliced: dict[str, tuple] = {}        # weight -> (dim, spans) already applied
        self.collectives: dict[str, Node] = {}    # node name -> the collective inserted after it
        self.rope_inputs = {i for n in graph.nodes if n.op == "rope" for i in n.inputs[:2]}

    def run(self) -> None:
        for node in list(self.g.nodes):
            if node.op == "moe":
                (self._experts if self.expert_parallel else self._expert_columns)(node)
            elif not self.tensor_parallel:
                continue
            elif node.op == "attention":
                self._attention(node)
            elif node.op == "silu_mul":
                self._mlp(node)
            elif node.op == "embedding":
                self._embedding(node)
            elif node.op == "logits":
                self._logits(node)
            elif node.op == "rms_norm" and node.outputs[0] in self.rope_inputs:
                raise KilnError(f"shard_tensor_parallel: {node.name} normalizes q or k over all heads (OLMoE); "
                                f"tp={self.mapping.tp} would split those heads across ranks: build it with tp=1")
        self._split_producers()
        nodes = []
        for node in self.g.nodes:
            nodes.append(node)
            if node.name in self.collectives:
                nodes.append(self.collectives[node.name])
        self.g.nodes = nodes

    # ------------------------------------------------------------------ what each block keeps

    def _attention(self, node: Node) -> None:
        hd = node.attrs["head_dim"]
        q_cols = [Span(self.heads.q.start * hd, self.heads.q.count * hd)]
        kv_cols = [Span(self.heads.kv.start * hd, self.heads.kv.count * hd)]
        q, k, v = node.inputs
        rope = self.defined_by.get(q)
        if rope is not None and rope.op == "rope":  # q and k reach attention through rope
            if rope.outputs != [q, k]:
                raise KilnError(f"shard_tensor_parallel: {node.name}: q and k come from different rope nodes")
            self._set_heads(rope)
            self._resize(rope.outputs[0], q_cols[0].count)
            self._resize(rope.outputs[1], kv_cols[0].count)
            q, k = rope.inputs[0], rope.inputs[1]
        q, k = self._through_head_norm(q, q_cols[0].count), self._through_head_norm(k, kv_cols[0].count)
        self._keep(q, q_cols)
        self._keep(k, kv_cols)
        self._keep(v, kv_cols)
        self._set_heads(node)
        self._resize(node.outputs[0], q_cols[0].count)
        for user in self.users[node.outputs[0]]:
            self._row_split(user, q_cols)

    def _through_head_norm(self, value: str, width: int) -> str:
        """The input of a head_rms_norm producing `value` (resized to this rank's heads), else `value`: a
        per-head norm keeps whole heads, so its weight [head_dim] is the same on every rank."""
        norm = self.defined_by.get(value)
        if norm is None or norm.op != "head_rms_norm":
            return value
        self._resize(norm.outputs[0], width)
        return norm.inputs[0]

    def _mlp(self, node: Node) -> None:
        cols = [Span(self.mlp.start, self.mlp.count)]
        if len(node.inputs) == 2:
            self._keep(node.inputs[0], cols)
            self._keep(node.inputs[1], cols)
        else:  # one [T, 2I] input: gate columns, then up columns
            width = self.g.values[node.inputs[0]].shape[-1] // 2
            self._keep(node.inputs[0], cols + [Span(width + self.mlp.start, self.mlp.count)])
        self._resize(node.outputs[0], self.mlp.count)
        for user in self.users[node.outputs[0]]:
            self._row_split(user, cols)

    def _experts(self, node: Node) -> None:
        """Keep this rank's experts (and, on tp rank 0, the shared expert) of a moe node; all_reduce its output."""
        count, ranks, rank = node.attrs["num_experts"], self.mapping.tp, self.mapping.tp_rank
        mine = list(range(rank * count // ranks, (rank + 1) * count // ranks))
        kept = {e["name"] for e in held_linears({**node.attrs, "experts": mine})}
        linears, inputs = [], [node.inputs[0]]
        for view in expert_linears(node):
            if view.base not in kept or (view.base.startswith("shared_expert") and rank):
                continue
            linears.append(view.attrs)
            inputs += view.inputs[1:]
        node.inputs = inputs
        node.attrs.update(linears=linears, experts=mine, shared=node.attrs.get("shared", False) and rank == 0)
        self._collective_after(node, "all_reduce", {"group": "tp"})

    def _expert_columns(self, node: Node) -> None:
        """Split every expert of a moe node (and its shared expert) by intermediate columns, as a dense MLP: gate
        and up keep this rank's rows, down its input columns; the router stays whole. The partial outputs are
        summed by an all_reduce (the shared expert's scale, sigmoid of its gate, multiplies each rank's part)."""
        for view in expert_linears(node):
            name = view.base
            if not name.startswith(("experts.", "shared_expert.")):
                continue
            stacked = name.endswith("gate_up_proj")  # gate | up (passes/fuse_gate_up.py): this rank's rows of each
            size = view.attrs["in_features" if name.endswith("down_proj") else "out_features"] // (2 if stacked else 1)
            try:
                span = self.mapping.columns(size, f"{node.name}.{name} columns")
            except ValueError as exc:
                raise KilnError(f"shard_tensor_parallel: {exc}") from None
            if name.endswith("down_proj"):
                self._slice_inputs(view, [span])
            else:
                self._column_split(view, [span, Span(size + span.start, span.count)] if stacked else [span])
        self._collective_after(node, "all_reduce", {"group": "tp"})

    def _embedding(self, node: Node) -> None:
        for name in node.inputs[1:]:
            if self.g.weights[name].shape[0] == node.attrs["vocab_size"]:
                self._slice(name, 0, [self.vocab])
        node.attrs.update(vocab_start=self.vocab.start, vocab_size=self.vocab.count,
                          full_vocab_size=self.full_vocab)
        self._collective_after(node, "all_reduce", {"group": "tp"})

    def _logits(self, node: Node) -> None:
        self._column_split(node, [self.vocab])
        sizes = self.mapping.column_sizes(self.full_vocab)
        self._collective_after(node, "all_gather", {"group": "tp", "sizes": sizes})

    @property
    def full_vocab(self) -> int:
        return self.g.meta["model"]["vocab_size"]

    # ------------------------------------------------------------------ column splits

    def _keep(self, value: str, spans: list[Span]) -> None:
        if self.kept.setdefault(value, spans) != spans:
            raise KilnError(f"shard_tensor_parallel: %{value} feeds two blocks that shard it differently")

    def _split_producers(self) -> None:
        """Column-split the producer of every kept value: a linear, or a split of a fused linear."""
        splits: dict[str, Node] = {}
        for value, spans in self.kept.items():
            producer = self.defined_by.get(value)
            if producer is not None and producer.op == "linear":
                self._column_split(producer, spans)
            elif producer is not None and producer.op == "split":
                splits[producer.name] = producer
            else:
                what = f"a {producer.op} node" if producer else "no node"
                raise KilnError(f"shard_tensor_parallel: %{value} comes from {what}; expected a linear or a split")
        for split in splits.values():
            missing = [o for o in split.outputs if o not in self.kept]
            if missing:
                raise KilnError(f"shard_tensor_parallel: {split.name}: part %{missing[0]} has no known share")
            spans, offset = [], 0
            for size, part in zip(split.attrs["sizes"], split.outputs):
                spans += [Span(offset + s.start, s.count) for s in self.kept[part]]
                offset += size
                self._resize(part, sum(s.count for s in self.kept[part]))
            split.attrs["sizes"] = [sum(s.count for s in self.kept[p]) for p in split.outputs]
            producer = self.defined_by.get(split.inputs[0])
            if producer is None or producer.op != "linear":
                raise KilnError(f"shard_tensor_parallel: {split.name} does not split a linear's output")
            self._column_split(producer, spans)

    def _column_split(self, node, spans: list[Span]) -> None:
        """Keep the output features `spans` of a linear/logits node (or a linear inside a moe node): rows of every
        per-row operand."""
        _require_logical(node)
        rows = node.attrs["out_features"]
        for name in node.inputs[1:]:
            if self.g.weights[name].shape[0] == rows:  # per-tensor scales stay whole
                self._slice(name, 0, spans)
        node.attrs["out_features"] = sum(s.count for s in spans)
        if node.outputs:  # a moe node's linear has none: the moe node's output keeps its width
            self._resize(node.outputs[0], node.attrs["out_features"])

    # ------------------------------------------------------------------ row splits

    def _row_split(self, node: Node, spans: list[Span]) -> None:
        """Keep the input features `spans` of a linear and all_reduce its partial output."""
        if node.op != "linear":
            raise KilnError(f"shard_tensor_parallel: {node.name} ({node.op}) reads a sharded value; expected a linear")
        self._slice_inputs(node, spans)
        self._collective_after(node, "all_reduce", {"group": "tp"})

    def _slice_inputs(self, node, spans: list[Span]) -> None:
        """Keep the input features `spans` of a linear (or a linear inside a moe node): columns of its weight and
        of its group-wise scales; its bias on tp rank 0 only (a partial sum follows)."""
        _require_logical(node)
        k, group = node.attrs["in_features"], node.attrs.get("group_size")
        roles = node.attrs.get("operands", ["weight", "bias"][: len(node.inputs) - 1])
        inputs, kept_roles = [node.inputs[0]], []
        for role, name in zip(roles, node.inputs[1:]):
            shape = self.g.weights[name].shape
            if role == "bias":
                if self.mapping.tp_rank != 0:
                    continue  # the bias joins the sum once
            elif len(shape) == 2 and shape[1] == k:
                self._slice(name, 1, spans)
            elif len(shape) == 2 and group and shape[1] * group == k:  # group-wise scales/zeros
                if any(s.start % group or s.count % group for s in spans):
                    raise KilnError(
                        f"shard_tensor_parallel: {node.name}: this rank's input columns "
                        f"{[(s.start, s.stop) for s in spans]} do not fall on group_size={group} boundaries; "
                        f"choose a tp that splits the heads/intermediate size into multiples of {group}, "
                        f"or a smaller group_size")
                self._slice(name, 1, [Span(s.start // group, s.count // group) for s in spans])
            inputs.append(name)
            kept_roles.append(role)
        node.inputs = inputs
        if "operands" in node.attrs:
            node.attrs["operands"] = kept_roles
        node.attrs["in_features"] = sum(s.count for s in spans)

    # ------------------------------------------------------------------ helpers

    def _collective_after(self, node: Node, op: str, attrs: dict) -> None:
        """The node's output becomes <name>.partial (all_reduce) or <name>.shard (all_gather); the
        collective gives back the original value, so its readers are unchanged."""
        full = node.outputs[0]
        local = f"{full}.partial" if op == "all_reduce" else f"{full}.shard"
        shape, dtype = self.g.values[full].shape, self.g.values[full].dtype
        self.g.values[local] = Value(local, dtype, shape)
        if op == "all_gather":  # the gathered value is as wide as every rank's share together
            self.g.values[full] = Value(full, dtype, (*shape[:-1], sum(attrs["sizes"])))
        node.outputs = [local]
        self.collectives[node.name] = Node(f"{node.name}.{op}", op, [local], [full], attrs, node.layer)

    def _set_heads(self, node: Node) -> None:
        node.attrs["num_heads"] = self.heads.q.count
        node.attrs["num_kv_heads"] = self.heads.kv.count

    def _resize(self, value: str, width: int) -> None:
        v = self.g.values[value]
        self.g.values[value] = Value(value, v.dtype, (*v.shape[:-1], width))

    def _slice(self, name: str, dim: int, spans: list[Span]) -> None:
        """The weight keeps the `spans` of dimension `dim` (lazily: sliced when the tensor is read)."""
        spec = (dim, tuple(spans))
        if name in self.sliced:
            if self.sliced[name] != spec:
                raise KilnError(f"shard_tensor_parallel: @{name} is read by two nodes that shard it differently")
            return
        self.sliced[name] = spec
        w = self.g.weights[name]
        shape = list(w.shape)
        shape[dim] = sum(s.count for s in spans)
        self.g.weights[name] = Value(name, w.dtype, tuple(shape))
        self.g.tensors.derive(name, [name], lambda t: _take(t, dim, spans))


def _take(tensor: torch.Tensor, dim: int, spans: list[Span]) -> torch.Tensor:
    parts = [tensor.narrow(dim, s.start, s.count) for s in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _require_logical(node: Node) -> None:
    if node.attrs.get("quant", "none") != "none" and node.attrs.get("layout", "logical") != "logical":
        raise KilnError(f"shard_tensor_parallel: {node.name} holds packed operands (layout "
                        f"{node.attrs['layout']!r}); sharding needs the logical layout, so pack after sharding")
