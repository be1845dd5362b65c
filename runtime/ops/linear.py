"""Linear layers over packed weights: checked calls into _native._qlinear, bound once per node.

y = x @ w.T + bias, w the dequantized weight [N, K] of a format in runtime.weights.FORMATS.
Activations: act="f32" computes in fp32 against the dequantized weights (matches the float
reference to fp32 rounding); act="int16", "int12" and "int8" (int4/int8 weights only) quantize x per
token and block (step amax / 32767, amax / 2047, amax / 127) and use integer dot products, error bounded
by that rounding. int16 keeps chat answers equal to the float model's and runs on AVX2 (vpmaddwd) and
AVX-512 VNNI (vpdpwssd); int12 runs int16's kernels except on AMX, where a q4 block's 32 codes take one
tile multiply (int16's take two); int8 (AVX2 vpmaddubsw, AVX-512 VNNI vpdpbusd) changes answers, as
llama.cpp's and ONNX Runtime's int8 activations do. CPUs with neither run the portable C path, far
slower than f32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime._native import _qlinear as _C
from runtime.ops.checks import buffer, describe, expect_shape, fail, threads
from runtime.ops.tape import Outputs, recordable, unrecorded
from runtime.weights import FORMATS, WeightFormat, bf16, fp8, int4, int8

ACT_MODES = {"f32": _C.ACT_F32, "int8": _C.ACT_INT8, "int16": _C.ACT_INT16, "int12": _C.ACT_INT12}


def isa() -> str:
    """Kernels in use: "amx" (AVX-512's, with AMX-INT8 tile multiplies for integer activations' steps of
    16 tokens and more), "avx512" (AVX-512 F/BW/DQ/VL + VNNI), "avx2" or "portable"."""
    return _C.isa()


def set_isa(name: str) -> str:
    """Pick the kernels: "auto", "amx", "avx512", "avx2" or "portable" (tests cover every path with it)."""
    return _C.set_isa(name)


class BoundLinear:
    """A checked linear y = x @ w.T + bias over packed weights, bound once; a call checks only x (and out)."""

    def __init__(self, fn: str, fmt: int, checked: tuple, n: int, k: int, group: int, bias, act: str):
        codes, scales, zeros, scales_f16 = checked
        if act not in ACT_MODES:
            fail(fn, f"act must be one of {sorted(ACT_MODES)}, got {act!r}")
        if act != "f32" and (fmt not in (_C.FMT_Q4, _C.FMT_Q8) or k % 32 or group % 32):
            fail(fn, f"act={act!r} needs int4/int8 weights with in_features and group_size multiples of 32")
        if bias is not None:
            expect_shape(fn, "bias", bias, torch.float32, (n,))
            if not bias.is_contiguous():
                fail(fn, "bias must be contiguous")
        self.fn, self.n, self.k = fn, n, k
        self.handle = _C.bind(fmt, ACT_MODES[act], buffer(codes), buffer(scales), buffer(zeros), buffer(bias),
                              n, k, group, bool(scales_f16))  # holds the weight buffers while it lives

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, num_threads: int | None = None):
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k
                or not x.is_contiguous() or not x.is_cpu):
            fail(self.fn, f"x must be a contiguous f32 CPU tensor [T, {self.k}], got {describe(x)}")
        t = x.shape[0]
        if out is None:
            out = torch.empty((t, self.n), dtype=torch.float32)
        elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (t, self.n)
              or not out.is_contiguous() or not out.is_cpu):
            fail(self.fn, f"out must be a contiguous f32 CPU tensor [{t}, {self.n}], got {describe(out)}")
        _C.run(self.handle, out.data_ptr(), x.data_ptr(), t, threads(num_threads))
        return out


def bind(fmt: WeightFormat, packed: dict, out_features: int, in_features: int, group_size: int | None = None,
         bias=None, act: str = "f32") -> BoundLinear:
    """The format's kernel over checked packed weights; a format without an integer path computes in f32."""
    fn = f"linear_{fmt.name}"
    checked = fmt.check(fn, packed, out_features, in_features, group_size)
    return BoundLinear(fn, fmt.kernel, checked, out_features, in_features, group_size or in_features, bias,
                       act if fmt.integer_activations else "f32")


# ---------------------------------------------------------------------------------------------
# Checked calls, one per format: y f32 [T, N] = x f32 [T, K] @ dequantized(packed).T (+ bias f32 [N])

def linear_int4(x, packed, out_features, in_features, group_size, bias=None, *, act="f32", out=None,
                num_threads=None) -> torch.Tensor:
    return bind(int4.FORMAT, packed, out_features, in_features, group_size, bias, act)(x, out, num_threads)


def linear_int8(x, packed, out_features, in_features, group_size=None, bias=None, *, act="f32", out=None,
                num_threads=None) -> torch.Tensor:
    return bind(int8.FORMAT, packed, out_features, in_features, group_size, bias, act)(x, out, num_threads)


def linear_fp8(x, packed, out_features, in_features, bias=None, *, out=None, num_threads=None) -> torch.Tensor:
    return bind(fp8.FORMAT, packed, out_features, in_features, None, bias)(x, out, num_threads)


def linear_bf16(x, packed, out_features, in_features, bias=None, *, out=None, num_threads=None) -> torch.Tensor:
    return bind(bf16.FORMAT, packed, out_features, in_features, None, bias)(x, out, num_threads)


# ---------------------------------------------------------------------------------------------
# Node binders (runtime/ops/program.py): bind once per linear/logits/embedding node

def operands_of(node_inputs: list[str], attrs: dict, tensors: dict) -> dict[str, torch.Tensor]:
    """Role -> tensor for a linear/logits/embedding node whose inputs[1:] are weights."""
    roles = attrs.get("operands", ["weight"])
    return {role: tensors[name] for role, name in zip(roles, node_inputs[1:])}


def node_format(attrs: dict) -> WeightFormat:
    """The node's weight format, its packed layout checked against the one this runtime reads."""
    quant = attrs.get("quant")
    if quant not in FORMATS:
        fail("qlinear", f"quant {quant!r} is not one of {sorted(FORMATS)}")
    layout = FORMATS[quant].layout
    if attrs.get("layout") != layout:
        fail("qlinear", f"{quant} weights in layout {attrs.get('layout')!r}; this runtime reads "
                        f"{layout!r} (rebuild the engine)")
    return FORMATS[quant]


def bind_linear(attrs: dict, operands: dict[str, torch.Tensor], reuse: bool = False):
    """A callable x f32 [T, K] -> [T, N] for a float or packed linear/logits node; operands are the weight
    tensors by role (+ "bias"). reuse keeps a packed linear's output buffer while T stays the same."""
    bias = operands.get("bias")
    if attrs.get("quant", "none") == "none":
        weight = operands["weight"]
        if weight.dtype != torch.float32:
            return lambda x: F.linear(x.to(weight.dtype), weight, bias).float()
        return lambda x: F.linear(x, weight, bias)
    n, k = attrs["out_features"], attrs["in_features"]
    bound = bind(node_format(attrs), operands, n, k, attrs.get("group_size"), bias, attrs.get("act", "f32"))
    outputs = Outputs((n,), reuse)

    def run(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            unrecorded()  # the copy would not outlive the call: a tape cannot replay it
            x = x.contiguous()
        return bound(x, outputs.get(x)[0][0])

    return recordable(run)


def bind_embedding(attrs: dict, operands: dict[str, torch.Tensor], reuse: bool = False):
    """A callable tokens i64 [T] -> f32 [T, H] for an embedding node (a float or packed table [V, H]),
    taking only this rank's rows [vocab_start, vocab_start + vocab_size) of a sharded vocabulary. reuse: a
    packed table's rows go to a kept buffer (runtime.ops.tape.Outputs)."""
    start, vocab = attrs.get("vocab_start", 0), attrs["vocab_size"]
    if attrs.get("quant", "none") == "none":
        weight = operands["weight"]
        rows = lambda ids: weight[ids].float()  # noqa: E731
    else:
        rows = _packed_rows(attrs, operands, reuse)
    if start == 0 and vocab == attrs.get("full_vocab_size", vocab):
        return rows

    def sharded(tokens):
        # another rank's ids read row 0 here and are zeroed in place: the rows' buffer is what the node
        # returns (a kept Outputs that runtime.ops.program.Program may share between nodes must hold the value)
        local = tokens - start
        outside = (local < 0) | (local >= vocab)
        return rows(local.clamp(0, vocab - 1)).masked_fill_(outside[:, None], 0.0)

    return sharded


def _packed_rows(attrs: dict, operands: dict[str, torch.Tensor], reuse: bool = False):
    """Rows of a packed table, dequantized in C with one rounding per element; ids outside the table are a
    ValueError before any row is read."""
    fmt = node_format(attrs)
    v, h = attrs["vocab_size"], attrs.get("hidden_size", attrs.get("in_features"))
    handle = bind(fmt, operands, v, h, attrs.get("group_size")).handle
    outputs = Outputs((h,), reuse)

    def rows(tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.is_contiguous():
            fail("embedding", f"tokens must be a contiguous int64 [T], got {describe(tokens)}")
        out = outputs.for_rows(tokens.shape[0])
        _C.rows(handle, out.data_ptr(), tokens.data_ptr(), tokens.shape[0], threads())
        return out

    return recordable(rows)
