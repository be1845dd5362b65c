"""`kiln::MoE`: a mixture-of-experts MLP as one ONNX node, and its reference body.

The node is what a grouped-expert TensorRT plugin (or TensorRT for RTX's own MoE layer) implements; the body is a
local ONNX function of standard operators that ONNX Runtime runs as it is, and that TensorRT's parser inlines
when no plugin of that name is registered. The body is dense: every held expert runs on every token and the
routing weights of the experts a token did not choose are zeros, so its result is the sparse mixture's (a sum
over the same products, in another order) at E / top_k times the work.

Inputs (H hidden, E experts the router scores, El experts this rank holds, I an expert's width):

    x [T, H]                    activations (the plan's dtype)
    router [H, E] f32           logits = x @ router, softmax over E in f32, the top_k largest kept
    held [El] i64               the global ids of the experts below (expert parallelism holds a subset)
    gate_up [El, H, 2I]         each held expert's gate | up projection (activations' dtype)
    down [El, I, H]
    MoEShared adds: shared_gate_up [H, 2Is], shared_down [Is, H], shared_gate [H, 1]: the shared expert, scaled
    by sigmoid(x @ shared_gate)

Attributes: top_k (int), renormalise (float: 1.0 divides the kept weights by their sum, as Mixtral and
Qwen3-MoE do; 0.0 keeps the softmax's). The gated activation is SiLU's, the one every supported family uses.
Output: out [T, H] in the activations' dtype.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from builder.targets.tensorrt.onnx_attention import DOMAIN, PLUGIN_VERSION, _Body, _ref_attr

OP, OP_SHARED = "MoE", "MoEShared"
INPUTS = ("x", "router", "held", "gate_up", "down")
SHARED_INPUTS = ("shared_gate_up", "shared_down", "shared_gate")


def moe_function(act: int, shared: bool) -> onnx.FunctionProto:
    """The reference body for activations of ONNX type `act`, with or without a shared expert."""
    b = _Body()
    f32 = TensorProto.FLOAT
    minus_one = b.const([-1])
    top_k = "top_k"
    b.nodes.append(helper.make_node("Constant", [], ["top_k_scalar"]))
    b.nodes[-1].attribute.append(_ref_attr("value_int", "top_k", onnx.AttributeProto.INT))
    b("Reshape", "top_k_scalar", b.const([1]), out=top_k)
    b.nodes.append(helper.make_node("Constant", [], ["renormalise"]))
    b.nodes[-1].attribute.append(_ref_attr("value_float", "renormalise", onnx.AttributeProto.FLOAT))

    # routing in f32: the softmax over every expert, its top_k, renormalised or not; then the weights of the held
    # experts, zero where the token chose another
    probs = b("Softmax", b("MatMul", b("Cast", "x", to=f32), "router"), axis=-1)              # [T, E]
    b.nodes.append(helper.make_node("TopK", [probs, top_k], ["kept", "chosen"], axis=-1, largest=1, sorted=1))
    one = b.const(1.0, np.float32)
    scale = b("Add", b("Mul", "renormalise", b("ReduceSum", "kept", minus_one, keepdims=1)),
              b("Sub", one, "renormalise"))                                                # the kept sum, or 1
    zeros = b("Mul", probs, b.const(0.0, np.float32))
    dense = b("ScatterElements", zeros, "chosen", b("Div", "kept", scale), axis=1)            # [T, E]
    weights = b("Cast", b("Transpose", b("Gather", dense, "held", axis=1), perm=[1, 0]), to=act)  # [El, T]

    def gated(x: str, gate_up: str, down: str) -> str:
        h = b("MatMul", x, gate_up)
        gate, up = _split_halves(b, h)
        return b("MatMul", b("Mul", b("Mul", gate, b("Sigmoid", gate)), up), down)

    experts = gated(b("Unsqueeze", "x", b.const([0])), "gate_up", "down")                       # [El, T, H]
    mixed = b("ReduceSum", b("Mul", experts, b("Unsqueeze", weights, minus_one)), b.const([0]), keepdims=0)
    if shared:
        own = gated("x", "shared_gate_up", "shared_down")                                        # [T, H]
        mixed = b("Add", mixed, b("Mul", own, b("Sigmoid", b("MatMul", "x", "shared_gate"))))
    b("Identity", mixed, out="out")
    inputs = list(INPUTS) + (list(SHARED_INPUTS) if shared else [])
    return helper.make_function(DOMAIN, OP_SHARED if shared else OP, inputs, ["out"], b.nodes,
                                [helper.make_opsetid("", 21)], attributes=["top_k", "renormalise"])


def _split_halves(b: _Body, h: str) -> tuple[str, str]:
    """The gate and up halves of the last dimension of h."""
    half = b("Div", b("Gather", b("Shape", h), b.const([-1]), axis=0), b.const([2]))
    gate = b("Slice", h, b.const([0]), half, b.const([-1]))
    up = b("Slice", h, half, b.const([1 << 62]), b.const([-1]))
    return gate, up


def moe_node(name: str, inputs: list[str], output: str, top_k: int, renormalise: bool, shared: bool) -> onnx.NodeProto:
    """A `kiln::MoE` (or `kiln::MoEShared`) node with the attributes TensorRT's parser maps to a plugin's fields."""
    return helper.make_node(OP_SHARED if shared else OP, inputs, [output], name=name, domain=DOMAIN,
                            top_k=int(top_k), renormalise=1.0 if renormalise else 0.0,
                            plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)
