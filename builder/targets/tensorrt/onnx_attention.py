"""`kiln::PagedAttention`: one attention layer's step as one ONNX node, and its reference body.

The node is what a TensorRT plugin implements (docs/tensorrt.md states the contract); the body is a
local ONNX function of standard operators, so ONNX Runtime runs the node as it is, and TensorRT's
parser inlines the body when no plugin of that name is registered (correct, and slow: it gathers
every token's keys through the block table).

Inputs, packed token-major like the cpu target's step (runtime/backends/step.py):

    q [T, nh*hd], k [T, nkv*hd], v [T, nkv*hd]         activations (the plan's dtype)
    positions [T] i64, rope_table [R, hd] f32         the rotary table by position: cos | sin of the first half
    k_cache, v_cache [blocks, block_size, nkv, hd]      one layer's KV pools (the cache dtype)
    slot_mapping [T] i64, block_tables [S, B] i32, context_lens [S] i32, query_start_loc [S+1] i32
    kv_scale [] f32                                      int8/fp8 caches store k / kv_scale

An fp8 (e4m3) cache is an int8 pool of e4m3 bit patterns: ONNX defines ScatterND and GatherND for no float8
type, so the body writes and reads the codes as bytes (rounded by QuantizeLinear to e4m3, then numbered;
decoded through a 256-entry table), and the plugin's kernels, which take the pool's address, read the same
bytes as e4m3. (TensorRT takes uint8 tensors only as network inputs or from casts, so the bytes are int8; an
int8 KV cache proper is a cpu kernel path, which the tensorrt target does not offer.)

Outputs: out [T, nh*hd] (the activations' dtype) and k_cache_out, v_cache_out, the pools after
this step's keys and values are written. A runtime binds each pool and its output to one buffer:
ONNX Runtime's ScatterND then writes in place, and a plugin does the same by contract.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

DOMAIN = "kiln"
OP = "PagedAttention"
PLUGIN_VERSION = "1"
INPUTS = ("q", "k", "v", "positions", "rope_table", "k_cache", "v_cache", "slot_mapping", "block_tables",
          "context_lens", "query_start_loc", "kv_scale")
# Attributes beyond scale and window, for the plugin: its kernels by variant key (builder/targets/tensorrt/
# plugin_kernels.py), the cache scale as a constant, and the queries one attention program covers.
PLUGIN_ATTRIBUTES = ("kv_scale", "queries_per_tile", "rope_kernel", "kv_write_kernel", "attention_kernel")
OUTPUTS = ("out", "k_cache_out", "v_cache_out")

# The ONNX type of an fp8 (e4m3) cache's pools: their bit patterns, one byte a value (see the module doc).
FP8_POOL = TensorProto.INT8
# The cache types written with a scale (fp8, through its codes); the rest are Cast.
SCALED_CACHES = (FP8_POOL,)


class _Body:
    """Nodes of a function body with generated names for intermediate values."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def __call__(self, op: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self.count += 1
        name = out or f"t{self.count}"
        self.nodes.append(helper.make_node(op, list(inputs), [name], **attrs))
        return name

    def const(self, value, dtype=np.int64) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.nodes.append(helper.make_node("Constant", [], [name],
                                           value=onnx.numpy_helper.from_array(np.array(value, dtype=dtype))))
        return name


def paged_attention_function(act: int, cache: int) -> onnx.FunctionProto:
    """The reference body for activations of ONNX type `act` and pools of type `cache`.

    Attributes: `scale` (float, the softmax scale) and `window` (int, the sliding window: a token at
    position p attends to p - window + 1 .. p; 0 for full causal attention). Everything else comes
    from the input shapes.
    """
    b = _Body()
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    zero, one = b.const([0]), b.const([1])
    kshape = b("Shape", "k_cache")
    block_size = b("Gather", kshape, b.const([1]), axis=0)
    kv_heads_dim = b("Slice", kshape, b.const([2]), b.const([4]))          # [nkv, hd]
    head_dim = b("Gather", kshape, b.const([3]), axis=0)
    tokens = b("Gather", b("Shape", "q"), zero, axis=0)
    scale = "softmax_scale"  # the node's `scale` attribute
    b.nodes.append(helper.make_node("Constant", [], [scale]))
    b.nodes[-1].attribute.append(_ref_attr("value_float", "scale", onnx.AttributeProto.FLOAT))

    # Rotary embedding of q and k (in f32), as runtime.ops.reference._rotate: halves (x1, x2) become
    # (x1 cos - x2 sin, x2 cos + x1 sin).
    rows = b("Gather", "rope_table", "positions", axis=0)                     # [T, hd]: cos | sin
    half = b("Div", head_dim, b.const([2]))
    cos = b("Unsqueeze", b("Slice", rows, zero, half, one), one)             # [T, 1, hd/2]
    sin = b("Unsqueeze", b("Slice", rows, half, head_dim, one), one)

    def rotate(x: str) -> str:
        heads = b("Reshape", b("Cast", x, to=f32), b("Concat", tokens, b.const([-1]), head_dim, axis=0))
        x1 = b("Slice", heads, zero, half, b.const([2]))
        x2 = b("Slice", heads, half, head_dim, b.const([2]))
        first = b("Sub", b("Mul", x1, cos), b("Mul", x2, sin))
        second = b("Add", b("Mul", x2, cos), b("Mul", x1, sin))
        return b("Concat", first, second, axis=2)                          # [T, heads, hd] f32

    q = rotate("q")
    k = rotate("k")
    v = b("Reshape", b("Cast", "v", to=f32), b("Concat", tokens, kv_heads_dim, axis=0))

    # KV write: token t's key and value go to slot slot_mapping[t] = block * block_size + offset.
    slot_block = b("Div", "slot_mapping", block_size)
    slot_offset = b("Mod", "slot_mapping", block_size)
    where = b("Concat", b("Unsqueeze", slot_block, one), b("Unsqueeze", slot_offset, one), axis=1)  # [T, 2]
    b("ScatterND", "k_cache", where, _to_cache(b, k, cache), out="k_cache_out")
    b("ScatterND", "v_cache", where, _to_cache(b, v, cache), out="v_cache_out")

    # Each token's sequence, and the last key position it attends to (inclusive).
    positions_t = b("Range", b.const(0), b("Squeeze", tokens, zero), b.const(1))     # [T]
    starts = b("Cast", "query_start_loc", to=i64)
    num_seqs = b("Gather", b("Shape", "context_lens"), zero, axis=0)
    ends = b("Slice", starts, one, b("Add", num_seqs, one))                           # [S]
    seq = b("ReduceSum", b("Cast", b("LessOrEqual", b("Unsqueeze", ends, zero), b("Unsqueeze", positions_t, one)),
                           to=i64), one, keepdims=0)                                  # [T]
    start = b("Gather", starts, seq, axis=0)
    qlen = b("Sub", b("Gather", starts, b("Add", seq, one), axis=0), start)
    context = b("Gather", b("Cast", "context_lens", to=i64), seq, axis=0)
    last = b("Add", b("Sub", context, qlen), b("Sub", positions_t, start))           # [T]

    # Every key slot of the token's sequence: block table row, block of key j, offset in the block.
    table = b("Cast", b("Gather", "block_tables", seq, axis=0), to=i64)               # [T, B]
    width = b("Mul", b("Gather", b("Shape", "block_tables"), one, axis=0), block_size)
    key_pos = b("Range", b.const(0), b("Squeeze", width, zero), b.const(1))           # [L]
    visible = b("LessOrEqual", b("Unsqueeze", key_pos, zero), b("Unsqueeze", last, one))  # [T, L]
    # A sliding window (the node's `window` > 0) also hides keys at or before last - window.
    window = "window"
    b.nodes.append(helper.make_node("Constant", [], [window]))
    b.nodes[-1].attribute.append(_ref_attr("value_int", "window", onnx.AttributeProto.INT))
    span = b("Where", b("Greater", window, b.const(0)), window, b.const(1 << 40))
    recent = b("Greater", b("Unsqueeze", key_pos, zero), b("Unsqueeze", b("Sub", last, span), one))
    visible = b("And", visible, recent)
    blocks = b("Gather", table, b("Div", key_pos, block_size), axis=1)                # [T, L]
    blocks = b("Where", visible, blocks, b.const(0))                                 # unused entries are -1
    offsets = b("Expand", b("Mod", key_pos, block_size), b("Shape", blocks))
    index = b("Concat", b("Unsqueeze", blocks, b.const([2])), b("Unsqueeze", offsets, b.const([2])), axis=2)
    keys = _from_cache(b, b("GatherND", "k_cache_out", index), cache)                # [T, L, nkv, hd] f32
    values = _from_cache(b, b("GatherND", "v_cache_out", index), cache)

    # Grouped-query attention: query head h reads kv head h // (nh / nkv).
    kv_heads = b("Gather", kshape, b.const([2]), axis=0)
    grouped = b("Reshape", q, b("Concat", tokens, kv_heads, b.const([-1]), head_dim, axis=0))   # [T, nkv, g, hd]
    scores = b("Mul", b("MatMul", grouped, b("Transpose", keys, perm=[0, 2, 3, 1])), scale)     # [T, nkv, g, L]
    mask = b("Where", visible, b.const(0.0, np.float32), b.const(-1e30, np.float32))
    mask = b("Unsqueeze", mask, b.const([1, 2]))
    probs = b("Softmax", b("Add", scores, mask), axis=-1)
    attended = b("MatMul", probs, b("Transpose", values, perm=[0, 2, 1, 3]))                     # [T, nkv, g, hd]
    flat = b("Reshape", attended, b("Concat", tokens, b.const([-1]), axis=0))
    b("Cast", flat, to=act, out="out")
    return helper.make_function(DOMAIN, OP, list(INPUTS), list(OUTPUTS), b.nodes,
                                opset_imports=[helper.make_opsetid("", 21)],
                                attributes=["scale", "window", "plugin_namespace", "plugin_version",
                                            *PLUGIN_ATTRIBUTES])


def _ref_attr(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    attr = onnx.AttributeProto()
    attr.name, attr.ref_attr_name, attr.type = name, ref, kind
    return attr


def _to_cache(b: _Body, x: str, cache: int) -> str:
    if cache == FP8_POOL:
        # x / kv_scale rounded to e4m3 (saturating, ties to even), then its code: the number of non-negative e4m3
        # values below its magnitude (codes 0x00-0x7e count up in value), and the sign bit, which makes the byte
        # code - 128 as an int8.
        zero_point = b("Constant", value=helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0]))
        rounded = b("Cast", b("QuantizeLinear", x, "kv_scale", zero_point), to=TensorProto.FLOAT)
        below = b("Less", b.const(E4M3_VALUES[:0x7F], np.float32), b("Unsqueeze", b("Abs", rounded), b.const([-1])))
        code = b("ReduceSum", b("Cast", below, to=TensorProto.INT64), b.const([-1]), keepdims=0)
        sign = b("Mul", b("Cast", b("Less", rounded, b.const(0.0, np.float32)), to=TensorProto.INT64), b.const(0x80))
        return b("Cast", b("Sub", code, sign), to=FP8_POOL)
    return b("Cast", x, to=cache)


def _from_cache(b: _Body, x: str, cache: int) -> str:
    if cache == FP8_POOL:  # e4m3 codes -> their values, times the scale (DequantizeLinear's arithmetic)
        byte = b("Mod", b("Add", b("Cast", x, to=TensorProto.INT64), b.const(0x100)), b.const(0x100))  # 0..255
        return b("Mul", b("Gather", b.const(E4M3_VALUES, np.float32), byte, axis=0), "kv_scale")
    return b("Cast", x, to=TensorProto.FLOAT)


def _e4m3_values() -> np.ndarray:
    """The value of every e4m3fn code 0..255 (NaN at 0x7f and 0xff), as torch decodes them."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


E4M3_VALUES = _e4m3_values()


def paged_attention_node(name: str, inputs: list[str], outputs: list[str], scale: float, window: int,
                         kernels: dict) -> onnx.NodeProto:
    """A `kiln::PagedAttention` node with the attributes TensorRT's parser maps to the plugin's fields;
    kernels: the PLUGIN_ATTRIBUTES (builder/targets/tensorrt/plugin_kernels.py's layer_kernels)."""
    return helper.make_node(OP, inputs, outputs, name=name, domain=DOMAIN, scale=float(scale), window=int(window),
                            plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION,
                            **{k: kernels[k] for k in PLUGIN_ATTRIBUTES})
