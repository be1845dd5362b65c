"""The per-op half of lowering a rank to ONNX (builder/targets/tensorrt/lower_onnx.py): one method per IR op,
mixed into the lowerer, which owns the segments, names and weights they emit into; and the weight conversions
they use (int4 codes packed for DequantizeLinear, formats TensorRT has no form for dequantized)."""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper

from builder.errors import KilnError
from builder.graph.experts import expert_linears
from builder.graph.ir import Graph, Node
from builder.targets.tensorrt.onnx_attention import (
    SCALED_CACHES,
    paged_attention_node,
)
from builder.targets.tensorrt.onnx_moe import moe_node
from builder.targets.tensorrt.plugin_kernels import layer_kernels
from runtime.ops.reference import RopeTable
from runtime.weights import fp8, int4, int5, int6, int8


def kv_names(layer: int) -> tuple[str, str, str, str]:
    """(k pool, v pool, k pool after the step, v pool after the step) of an attention layer."""
    return f"kv.{layer}.k", f"kv.{layer}.v", f"kv.{layer}.k.out", f"kv.{layer}.v.out"


class OpLowerings:
    """The lowerer's methods for each IR op (`_<op>(node)`), over its `_emit`, `_init`, `_float`, ... ."""

    def _embedding(self, node: Node) -> None:
        a = node.attrs
        table = _dequantized(node, self.graph)  # [V, H] f32
        if a.get("scale", 1.0) != 1.0:  # Gemma: rows times sqrt(hidden) in f32, as the cpu target computes them
            table = table * a["scale"]
        weight = self._float(f"{node.name}.table", table, self.act)
        tokens = node.inputs[0]
        start, vocab = a.get("vocab_start", 0), a["vocab_size"]
        out = node.outputs[0]
        if start == 0 and vocab == a.get("full_vocab_size", vocab):
            self._emit("Gather", [weight, tokens], [out], hint=node.name, axis=0)
        else:  # this rank's rows of a vocabulary split over tensor-parallel ranks; the all_reduce sums
            local = self._emit("Sub", [tokens, self._const(start)], hint=node.name)
            inside = self._emit("And", [self._emit("GreaterOrEqual", [local, self._const(0)], hint=node.name),
                                        self._emit("Less", [local, self._const(vocab)], hint=node.name)],
                                hint=node.name)
            rows = self._emit("Gather", [weight, self._emit("Clip", [local, self._const(0), self._const(vocab - 1)],
                                                            hint=node.name)], hint=node.name, axis=0)
            mask = self._emit("Cast", [self._emit("Unsqueeze", [inside, self._const([1])], hint=node.name)],
                              hint=node.name, to=self.act)
            self._emit("Mul", [rows, mask], [out], hint=node.name)
        self._define(out, self.act)

    def _linear(self, node: Node, logits: bool = False) -> None:
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        roles = dict(zip(a.get("operands", ["weight"]), node.inputs[1:]))
        quant, group = a.get("quant", "none"), a.get("group_size")
        n, k = a["out_features"], a["in_features"]
        name = node.name
        act = self.act
        if quant == "int4":
            q = self._tensor(roles["qweight"])
            codes = (q.to(torch.int16) - 8).t().contiguous().numpy().astype(np.int8)   # [K, N] in -8..7
            packed = _pack_int4(codes)
            wq = self._init(f"{name}.qweight", TensorProto.INT4, packed, (k, n))
            scales = self._float(f"{name}.scales", self._tensor(roles["scales"]), act, transpose=True)  # [K/G, N]
            weight = self._emit("DequantizeLinear", [wq, scales], hint=name, axis=0, block_size=group)
            y = self._emit("MatMul", [x, weight], hint=name)
            # + sum over groups g of (sum of x over g) * z[n, g]: the zero points, exactly, in f32.
            zeros = self._float(f"{name}.zeros", self._tensor(roles["zeros"]), TensorProto.FLOAT, transpose=True)
            grouped = self._emit("Reshape", [self._to_f32(x), self._const([0, k // group, group])], hint=name)
            sums = self._emit("ReduceSum", [grouped, self._const([2])], hint=name, keepdims=0)
            correction = self._emit("MatMul", [sums, zeros], hint=name)
            y = self._emit("Add", [y, self._to_act(correction)], hint=name)
        elif quant in ("int8", "fp8") and not (quant == "int8" and group):
            q = self._tensor(roles["qweight"])
            data_type = TensorProto.INT8 if quant == "int8" else TensorProto.FLOAT8E4M3FN
            codes = q.t().contiguous().view(torch.uint8 if quant == "fp8" else torch.int8).numpy()
            wq = self._init(f"{name}.qweight", data_type, codes.tobytes(), (k, n))
            s = self._tensor(roles["scales"]).reshape(-1)
            scales = self._float(f"{name}.scales", s if s.numel() > 1 else s.reshape(()), act)
            weight = self._emit("DequantizeLinear", [wq, scales], hint=name, **({"axis": 1} if s.numel() > 1 else {}))
            if "act_scale" in a:  # FP8 activations (passes/calibrate_fp8_activations.py): Q/DQ for an FP8 GEMM
                x_scale = self._float(f"{name}.act_scale", torch.tensor(float(a["act_scale"])), act)
                zero = f"{name}.act_zero"  # a float8 zero point: the type QuantizeLinear produces
                self.segment.initializers[zero] = helper.make_tensor(zero, TensorProto.FLOAT8E4M3FN, [], [0])
                x = self._emit("DequantizeLinear", [self._emit("QuantizeLinear", [x, x_scale, zero], hint=name),
                                                     x_scale], hint=name)
            y = self._emit("MatMul", [x, weight], hint=name)
        else:  # float, or int8 per group, int5, int6 (no TensorRT form): the dequantized weight
            weight = self._float(f"{name}.weight", _dequantized(node, self.graph), act, transpose=True)
            y = self._emit("MatMul", [x, weight], hint=name)
        if "bias" in roles:
            y = self._emit("Add", [y, self._float(f"{name}.bias", self._tensor(roles["bias"]), act)], hint=name)
        if logits:
            self._emit("Cast", [y], [out], to=TensorProto.FLOAT) if act != TensorProto.FLOAT else \
                self._emit("Identity", [y], [out])
            self._define(out, TensorProto.FLOAT)
        else:
            self._emit("Identity", [y], [out])
            self._define(out, act)

    def _logits(self, node: Node) -> None:
        self._linear(node, logits=True)

    def _norm(self, x: str, weight_name: str, eps: float, out: str, hint: str) -> None:
        xf = self._to_f32(x)
        mean = self._emit("ReduceMean", [self._emit("Mul", [xf, xf], hint=hint), self._const([-1])], hint=hint,
                          keepdims=1)
        inv = self._emit("Reciprocal", [self._emit("Sqrt", [self._emit("Add", [mean, self._const(eps, np.float32)],
                                                                         hint=hint)], hint=hint)], hint=hint)
        weight = self._float(f"{hint}.weight", self._tensor(weight_name), TensorProto.FLOAT)
        normed = self._emit("Mul", [self._emit("Mul", [xf, inv], hint=hint), weight], hint=hint)
        self._to_act(normed, [out])
        self._define(out, self.act)

    def _rms_norm(self, node: Node) -> None:
        self._norm(node.inputs[0], node.inputs[1], node.attrs["eps"], node.outputs[0], node.name)

    def _head_rms_norm(self, node: Node) -> None:
        """The norm over each head: x [T, heads * hd] as [T * heads, hd], normed, and back."""
        hd, x = node.attrs["head_dim"], node.inputs[0]
        rows = self._emit("Reshape", [x, self._const([-1, hd])], hint=node.name)
        self._define(rows, self.types[x])
        normed = f"{node.name}.heads"
        self._norm(rows, node.inputs[1], node.attrs["eps"], normed, node.name)
        self._emit("Reshape", [normed, self._emit("Shape", [x], hint=node.name)], [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.act)

    def _add_rms_norm(self, node: Node) -> None:
        x, residual, weight = node.inputs
        normed, total = node.outputs
        self._emit("Add", [x, residual], [total], hint=node.name)
        self._define(total, self.act)
        self._norm(total, weight, node.attrs["eps"], normed, node.name)

    def _split(self, node: Node) -> None:
        self._emit("Split", [node.inputs[0], self._const(node.attrs["sizes"])], list(node.outputs), hint=node.name,
                   axis=-1)
        for out in node.outputs:
            self._define(out, self.types[node.inputs[0]])

    def _silu_mul(self, node: Node) -> None:
        if len(node.inputs) == 1:
            width = self.graph.values[node.outputs[0]].shape[-1]
            gate, up = f"{node.name}.gate", f"{node.name}.up"
            self._emit("Split", [node.inputs[0], self._const([width, width])], [gate, up], hint=node.name, axis=-1)
        else:
            gate, up = node.inputs
        if node.attrs.get("act", "silu") == "gelu_tanh":  # Gemma's GeGLU: tanh-approximated gelu of the gate
            act = self._emit("Gelu", [gate], hint=node.name, approximate="tanh")
        else:
            act = self._emit("Mul", [gate, self._emit("Sigmoid", [gate], hint=node.name)], hint=node.name)
        self._emit("Mul", [act, up], [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.act)

    def _add(self, node: Node) -> None:
        self._emit("Add", list(node.inputs), [node.outputs[0]], hint=node.name)
        self._define(node.outputs[0], self.types[node.inputs[0]])

    def _gather_last(self, node: Node) -> None:
        self._emit("Gather", [node.inputs[0], "logits_indices"], [node.outputs[0]], hint=node.name, axis=0)
        self._define(node.outputs[0], self.types[node.inputs[0]])

    def _moe(self, node: Node) -> None:
        """A kiln::MoE node (builder/targets/tensorrt/onnx_moe.py): the router in f32, the held experts' weights
        stacked [El, H, 2I] and [El, I, H] in the activations' dtype (quantized experts dequantized, as the formats
        without a TensorRT form are), the shared expert's beside them."""
        a = node.attrs
        if a.get("act", "silu") != "silu":
            raise KilnError(f"lower_onnx: {node.name}: a mixture with the {a['act']} activation has no ONNX lowering")
        views = {view.base: view for view in expert_linears(node)}
        weight = {base: _dequantized(view, self.graph) for base, view in views.items()}  # [N, K] f32 each

        def stack(name: str, parts: list[torch.Tensor]) -> str:
            return self._float(f"{node.name}.{name}", torch.stack(parts), self.act)

        def gate_up(prefix: str) -> torch.Tensor:  # [2I, H]: stacked by fuse_gate_up, or the two projections
            if f"{prefix}.gate_up_proj" in weight:
                return weight[f"{prefix}.gate_up_proj"]
            return torch.cat([weight[f"{prefix}.gate_proj"], weight[f"{prefix}.up_proj"]])

        held = a["experts"]
        inputs = [node.inputs[0], self._float(f"{node.name}.router", weight["router"], TensorProto.FLOAT,
                                             transpose=True),
                  self._init(f"{node.name}.held", TensorProto.INT64, np.array(held, np.int64), (len(held),)),
                  stack("gate_up", [gate_up(f"experts.{e}").t() for e in held]),
                  stack("down", [weight[f"experts.{e}.down_proj"].t() for e in held])]
        shared = bool(a.get("shared", False))
        if shared:
            inputs += [self._float(f"{node.name}.shared_gate_up", gate_up("shared_expert"), self.act, transpose=True),
                       self._float(f"{node.name}.shared_down", weight["shared_expert.down_proj"], self.act,
                                   transpose=True),
                       self._float(f"{node.name}.shared_gate", weight["shared_expert_gate"], self.act, transpose=True)]
        self.segment.nodes.append(moe_node(node.name, inputs, node.outputs[0], a["top_k"], a["norm_topk_prob"],
                                           shared))
        self.segment.moe.add(shared)
        self._define(node.outputs[0], self.act)

    def _rope(self, node: Node) -> None:
        for which, out in enumerate(node.outputs):
            self.pending_rope[out] = (node, which)

    def _attention(self, node: Node) -> None:
        a = node.attrs
        q, k, v = node.inputs
        ropes = [self.pending_rope.pop(x, None) for x in (q, k)]
        if any(r is None for r in ropes) or ropes[0][0] is not ropes[1][0] or [r[1] for r in ropes] != [0, 1]:
            raise KilnError(f"lower_onnx: attention {node.name!r} must read the two outputs of one rope node")
        rope = ropes[0][0]
        table = self._rope_table(rope.attrs)
        node_kernels, variants = layer_kernels(a, self.activations, self.kv_dtype, self.block_size)
        self.kernels.update(variants)
        layer = a["layer"]
        k_in, v_in, k_out, v_out = kv_names(layer)
        scale = self._const(a.get("kv_scale", 1.0) if self.cache in SCALED_CACHES else 1.0, np.float32)
        inputs = [rope.inputs[0], rope.inputs[1], v, rope.inputs[2], table, k_in, v_in, "slot_mapping",
                  "block_tables", "context_lens", "query_start_loc", scale]
        self.segment.nodes.append(paged_attention_node(node.name, inputs, [node.outputs[0], k_out, v_out], a["scale"],
                                                      a.get("window", 0), node_kernels))
        self.segment.kv_layers.append(layer)
        self.layers[layer] = {**a, "block_size": self.block_size}
        self._define(node.outputs[0], self.act)

    def _rope_table(self, attrs: dict) -> str:
        """[max_seq_len, head_dim] f32: cos | sin of the first half by position, runtime.ops.reference.RopeTable's
        packed rows (what Kiln's rope kernel reads)."""
        scaling = attrs.get("scaling")
        key = f"rope.{attrs['head_dim']}.{attrs['theta']:g}" + (".scaled" if scaling else "")
        table = RopeTable(attrs["head_dim"], attrs["theta"], scaling)
        table.ensure(self.max_seq_len)
        return self._init(f"{key}.table", TensorProto.FLOAT, table.packed[:self.max_seq_len].contiguous().numpy(),
                          (self.max_seq_len, attrs["head_dim"]))


def _pack_int4(codes: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two values a byte, the first in the low nibble."""
    flat = codes.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def _dequantized(node: Node, graph: Graph) -> torch.Tensor:
    """The node's weight [N, K] (or table [V, H]) in f32, as the cpu target's kernels compute with it."""
    a = node.attrs
    roles = dict(zip(a.get("operands", ["weight"]), node.inputs[1:]))
    quant = a.get("quant", "none")
    tensors = graph.tensors
    if quant == "none":
        return tensors[roles["weight"]].float()
    if quant == "int4":
        return int4.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]], tensors[roles["zeros"]])
    if quant == "int5":
        return int5.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]], tensors[roles["mins"]])
    if quant == "int6":
        return int6.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    if quant == "int8":
        return int8.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    if quant == "fp8":
        return fp8.dequantize(tensors[roles["qweight"]], tensors[roles["scales"]])
    raise KilnError(f"lower_onnx: node {node.name!r}: weight format {quant!r} has no ONNX lowering")
