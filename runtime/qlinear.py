"""Quantized (and bf16) linear layers: packing into the kernels' panel layouts, checked calls into _native._qlinear.

Logical formats (w is the dequantized weight [N, K], y = x @ w.T + bias):
  int4  w[n,k] = (q[n,k] - 8) * scale[n, k//G] + zero[n, k//G], q in 0..15, G in {32, 64, 128}
  int8  w[n,k] = q[n,k] * scale[n] (per channel) or q[n,k] * scale[n, k//G] (group, e.g. GGUF Q8_0)
  fp8   w[n,k] = e4m3(q[n,k]) * scale[n]
  bf16  w as stored
Packed storage groups output rows in panels of 16 (rows padded with zeros to P = ceil(N/16) panels):
  "qweight" codes, panel-major (see runtime/_native/qlinear/layout.h for the byte order);
  "scales"  [P, K/G, 16] f32, or f16 when that is lossless (G = 1 group per channel: [P, 1, 16]);
  int4: "zeros" [P, K/G, 16] f32, or "mins" f16 (m = zero - 8 * scale) when f16 (scale, m) is lossless.
Activations: act="f32" computes in fp32 against the dequantized weights (matches the float
reference to fp32 rounding); act="int8" (int4/int8 only) quantizes x per token and block to int8
and uses VNNI dot products (faster for prefill; error bounded by the activation rounding).
"""

from __future__ import annotations

import torch

from runtime._native import _qlinear as _C
from runtime.native_ops import Outputs, recordable, unrecorded

LAYOUT_INT4 = "q4g.p16k8"     # codes uint8 [P, K/8, 64]
LAYOUT_INT8 = "q8.p16k4"      # codes int8 [P, K/4, 64]
LAYOUT_FP8 = "f8e4m3.p16k1"   # codes uint8 [P, K, 16]
LAYOUT_BF16 = "bf16.p16k1"    # codes bf16 [P, K, 16]
GROUP_SIZES = (32, 64, 128)
ACT_MODES = {"f32": _C.ACT_F32, "int8": _C.ACT_INT8}
PANEL = _C.PANEL


def isa() -> str:
    """Kernels in use: "avx512" (AVX-512 F/BW/DQ/VL + VNNI) or "portable"."""
    return _C.isa()


def set_isa(name: str) -> str:
    """Pick the kernels: "auto", "avx512" or "portable" (tests cover both paths with it)."""
    return _C.set_isa(name)


def _fail(fn: str, msg: str) -> None:
    raise ValueError(f"{fn}: {msg}")


def _expect(fn: str, name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device.type != "cpu":
        _fail(fn, f"{name} must be {dtype} {tuple(shape)} on cpu, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _panels(n: int) -> int:
    return (n + PANEL - 1) // PANEL


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [P*16, ...] with zero rows appended."""
    pad = _panels(t.shape[0]) * PANEL - t.shape[0]
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))]) if pad else t


def _panel_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, groups] -> [P, groups, 16]."""
    s = _pad_rows(s)
    return s.reshape(-1, PANEL, s.shape[1]).transpose(1, 2).contiguous()


def _row_scales(s: torch.Tensor, n: int) -> torch.Tensor:
    """[P, groups, 16] -> [N, groups]."""
    return s.transpose(1, 2).reshape(-1, s.shape[1])[:n]


def _f16_if_exact(s: torch.Tensor) -> torch.Tensor:
    half = s.half()
    return half if torch.equal(half.float(), s) else s


def _check_group(fn: str, k: int, group_size: int | None, allowed=GROUP_SIZES) -> None:
    if group_size not in allowed:
        _fail(fn, f"group_size must be one of {allowed}, got {group_size}")
    if group_size is not None and k % group_size:
        _fail(fn, f"in_features {k} is not divisible by group_size {group_size}")


# ---------------------------------------------------------------------------------------------
# Packing and dequantization

def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in 0..15, scales/zeros f32 [N, K/G] -> {"qweight", "scales", "zeros" | "mins"}."""
    fn = "pack_int4"
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        _fail(fn, "q must be a 2-D torch.Tensor [N, K]")
    n, k = q.shape
    _check_group(fn, k, group_size)
    _expect(fn, "q", q, torch.uint8, (n, k))
    _expect(fn, "scales", scales, torch.float32, (n, k // group_size))
    _expect(fn, "zeros", zeros, torch.float32, (n, k // group_size))
    if q.numel() and int(q.max()) > 15:
        _fail(fn, f"q values must lie in 0..15, found {int(q.max())}")
    cells = _pad_rows(q).reshape(-1, PANEL, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [P, K/8, 16, 4, lo|hi]
    qweight = (cells[..., 0] | (cells[..., 1] << 4)).reshape(-1, k // 8, 64).contiguous()
    packed = {"qweight": qweight}
    d = scales.half()
    m = (zeros.double() - 8 * scales.double()).half()
    if torch.equal(d.float(), scales) and torch.equal((m.double() + 8 * d.double()).float(), zeros):
        packed.update(scales=_panel_scales(d), mins=_panel_scales(m))  # lossless: 2 + 2 bytes per group
    else:
        packed.update(scales=_panel_scales(scales), zeros=_panel_scales(zeros))
    return packed


def unpack_int4(packed: dict, out_features: int, in_features: int, group_size: int):
    """The exact (q uint8 [N, K], scales f32 [N, K/G], zeros f32 [N, K/G]) that pack_int4 took."""
    codes, scales, zeros, _ = _check_int4("unpack_int4", packed, out_features, in_features, group_size)
    n, k = out_features, in_features
    c = codes.reshape(-1, k // 8, PANEL, 4)
    q = torch.stack([c & 15, c >> 4], dim=3)  # [P, K/8, 16, lo|hi, 4]
    q = q.permute(0, 2, 1, 3, 4).reshape(-1, k)[:n]
    s = _row_scales(scales, n).float()
    if "mins" in packed:
        z = (_row_scales(zeros, n).double() + 8 * s.double()).float()
    else:
        z = _row_scales(zeros, n)
    return q.contiguous(), s.contiguous(), z.contiguous()


def dequantize_int4(packed: dict, out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    """w f32 [N, K] = (q - 8) * scale + zero, rounded once from float64 (what the kernel computes)."""
    q, s, z = unpack_int4(packed, out_features, in_features, group_size)
    expand = lambda t: t.double().repeat_interleave(group_size, dim=1)  # noqa: E731
    return ((q.double() - 8) * expand(s) + expand(z)).float()


def pack_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """q int8 [N, K], scales f32 [N] (per channel, group_size None) or [N, K/G] -> {"qweight", "scales"}."""
    fn = "pack_int8"
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        _fail(fn, "q must be a 2-D torch.Tensor [N, K]")
    n, k = q.shape
    _check_group(fn, k, group_size, GROUP_SIZES + (None,))
    if k % 8:
        _fail(fn, f"in_features {k} must be a multiple of 8")
    _expect(fn, "q", q, torch.int8, (n, k))
    _expect(fn, "scales", scales, torch.float32, (n,) if group_size is None else (n, k // group_size))
    qweight = _pad_rows(q).reshape(-1, PANEL, k // 4, 4).transpose(1, 2).reshape(-1, k // 4, 64).contiguous()
    scales = scales.reshape(n, -1)
    return {"qweight": qweight, "scales": _panel_scales(_f16_if_exact(scales))}


def unpack_int8(packed: dict, out_features: int, in_features: int, group_size: int | None = None):
    """The exact (q int8 [N, K], scales f32 [N] or [N, K/G]) that pack_int8 took."""
    codes, scales, _, _ = _check_int8("unpack_int8", packed, out_features, in_features, group_size)
    n, k = out_features, in_features
    q = codes.reshape(-1, k // 4, PANEL, 4).transpose(1, 2).reshape(-1, k)[:n]
    s = _row_scales(scales, n).float()
    return q.contiguous(), (s[:, 0] if group_size is None else s).contiguous()


def dequantize_int8(packed: dict, out_features: int, in_features: int, group_size: int | None = None) -> torch.Tensor:
    q, s = unpack_int8(packed, out_features, in_features, group_size)
    s = s[:, None] if group_size is None else s.repeat_interleave(group_size, dim=1)
    return (q.double() * s.double()).float()


def pack_fp8(q: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q float8_e4m3fn (or its uint8 codes) [N, K], scales f32 [N] or a scalar -> {"qweight", "scales"}."""
    fn = "pack_fp8"
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        _fail(fn, "q must be a 2-D torch.Tensor [N, K]")
    if q.dtype == torch.float8_e4m3fn:
        q = q.view(torch.uint8)
    n, k = q.shape
    _expect(fn, "q", q, torch.uint8, (n, k))
    if k % 8:
        _fail(fn, f"in_features {k} must be a multiple of 8")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.numel() not in (1, n):
        _fail(fn, f"scales must be f32 [N={n}] or a single value")
    if bool(((q & 0x7F) == 0x7F).any()):
        _fail(fn, "q holds e4m3 NaN codes")
    qweight = _pad_rows(q).reshape(-1, PANEL, k).transpose(1, 2).contiguous()
    return {"qweight": qweight, "scales": _panel_scales(scales.reshape(-1).expand(n).reshape(n, 1).contiguous())}


def dequantize_fp8(packed: dict, out_features: int, in_features: int) -> torch.Tensor:
    codes, scales, _, _ = _check_fp8("dequantize_fp8", packed, out_features, in_features)
    q = codes.transpose(1, 2).reshape(-1, in_features)[:out_features].contiguous()
    values = q.view(torch.float8_e4m3fn).double()
    return (values * _row_scales(scales, out_features).double()).float()


def pack_bf16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] (rounded to bf16 if wider) -> {"qweight": bf16 [P, K, 16]}."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        _fail("pack_bf16", "w must be a 2-D floating torch.Tensor [N, K]")
    n, k = w.shape
    if k % 8:
        _fail("pack_bf16", f"in_features {k} must be a multiple of 8")
    return {"qweight": _pad_rows(w.to(torch.bfloat16)).reshape(-1, PANEL, k).transpose(1, 2).contiguous()}


def dequantize_bf16(packed: dict, out_features: int, in_features: int) -> torch.Tensor:
    codes = _check_bf16("dequantize_bf16", packed, out_features, in_features)[0]
    return codes.transpose(1, 2).reshape(-1, in_features)[:out_features].float()


# ---------------------------------------------------------------------------------------------
# Checks of packed tensors: (codes, scales, zeros, scales_f16) as the kernels take them

def _get(fn: str, packed: dict, key: str) -> torch.Tensor:
    if not isinstance(packed, dict) or key not in packed:
        _fail(fn, f"packed weights lack {key!r} (have {sorted(packed) if isinstance(packed, dict) else packed!r})")
    t = packed[key]
    if isinstance(t, torch.Tensor) and not t.is_contiguous():
        _fail(fn, f"packed {key!r} must be contiguous")
    return t


def _check_scales(fn: str, packed: dict, key: str, shape: tuple) -> torch.Tensor:
    s = _get(fn, packed, key)
    dtype = s.dtype if isinstance(s, torch.Tensor) and s.dtype in (torch.float16, torch.float32) else torch.float32
    _expect(fn, key, s, dtype, shape)
    return s


def _check_int4(fn, packed, n, k, group_size):
    _check_group(fn, k, group_size)
    p, ng = _panels(n), k // group_size
    codes = _get(fn, packed, "qweight")
    _expect(fn, "qweight", codes, torch.uint8, (p, k // 8, 64))
    scales = _check_scales(fn, packed, "scales", (p, ng, PANEL))
    zero_key = "mins" if "mins" in packed else "zeros"
    zeros = _check_scales(fn, packed, zero_key, (p, ng, PANEL))
    if (zero_key == "mins") != (scales.dtype == torch.float16) or zeros.dtype != scales.dtype:
        _fail(fn, "int4 packs f16 scales with f16 'mins', or f32 scales with f32 'zeros'")
    return codes, scales, zeros, scales.dtype == torch.float16


def _check_int8(fn, packed, n, k, group_size):
    _check_group(fn, k, group_size, GROUP_SIZES + (None,))
    if k % 8:
        _fail(fn, f"in_features {k} must be a multiple of 8")
    p = _panels(n)
    codes = _get(fn, packed, "qweight")
    _expect(fn, "qweight", codes, torch.int8, (p, k // 4, 64))
    scales = _check_scales(fn, packed, "scales", (p, 1 if group_size is None else k // group_size, PANEL))
    return codes, scales, None, scales.dtype == torch.float16


def _check_fp8(fn, packed, n, k):
    if k % 8:
        _fail(fn, f"in_features {k} must be a multiple of 8")
    codes = _get(fn, packed, "qweight")
    _expect(fn, "qweight", codes, torch.uint8, (_panels(n), k, PANEL))
    scales = _get(fn, packed, "scales")
    _expect(fn, "scales", scales, torch.float32, (_panels(n), 1, PANEL))
    return codes, scales, None, False


def _check_bf16(fn, packed, n, k):
    if k % 8:
        _fail(fn, f"in_features {k} must be a multiple of 8")
    codes = _get(fn, packed, "qweight")
    _expect(fn, "qweight", codes, torch.bfloat16, (_panels(n), k, PANEL))
    return codes, None, None, False


# ---------------------------------------------------------------------------------------------
# Calls

def _buffer(t: torch.Tensor | None):
    if t is None:
        return None
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.detach().numpy()


class BoundLinear:
    """A checked linear y = x @ w.T + bias over packed weights, bound once; a call checks only x (and out)."""

    def __init__(self, fn: str, fmt: int, checked: tuple, n: int, k: int, group: int, bias, act: str):
        codes, scales, zeros, scales_f16 = checked
        if act not in ACT_MODES:
            _fail(fn, f"act must be one of {sorted(ACT_MODES)}, got {act!r}")
        if act == "int8" and (fmt not in (_C.FMT_Q4, _C.FMT_Q8) or k % 32 or group % 32):
            _fail(fn, "act='int8' needs int4/int8 weights with in_features and group_size multiples of 32")
        if bias is not None:
            _expect(fn, "bias", bias, torch.float32, (n,))
            if not bias.is_contiguous():
                _fail(fn, "bias must be contiguous")
        self.fn, self.n, self.k = fn, n, k
        self.handle = _C.bind(fmt, ACT_MODES[act], _buffer(codes), _buffer(scales), _buffer(zeros), _buffer(bias),
                              n, k, group, bool(scales_f16))  # holds the weight buffers while it lives

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, num_threads: int | None = None):
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k
                or not x.is_contiguous() or not x.is_cpu):
            _fail(self.fn, f"x must be a contiguous f32 CPU tensor [T, {self.k}], got {_describe(x)}")
        t = x.shape[0]
        if out is None:
            out = torch.empty((t, self.n), dtype=torch.float32)
        elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (t, self.n)
              or not out.is_contiguous() or not out.is_cpu):
            _fail(self.fn, f"out must be a contiguous f32 CPU tensor [{t}, {self.n}], got {_describe(out)}")
        threads = torch.get_num_threads() if num_threads is None else int(num_threads)
        _C.run(self.handle, out.data_ptr(), x.data_ptr(), t, threads)
        return out


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{t.dtype} {tuple(t.shape)} {layout} on {t.device}"


def bind_int4(packed, out_features, in_features, group_size, bias=None, act="f32") -> BoundLinear:
    checked = _check_int4("linear_int4", packed, out_features, in_features, group_size)
    return BoundLinear("linear_int4", _C.FMT_Q4, checked, out_features, in_features, group_size, bias, act)


def bind_int8(packed, out_features, in_features, group_size=None, bias=None, act="f32") -> BoundLinear:
    checked = _check_int8("linear_int8", packed, out_features, in_features, group_size)
    return BoundLinear("linear_int8", _C.FMT_Q8, checked, out_features, in_features, group_size or in_features,
                       bias, act)


def bind_fp8(packed, out_features, in_features, bias=None) -> BoundLinear:
    checked = _check_fp8("linear_fp8", packed, out_features, in_features)
    return BoundLinear("linear_fp8", _C.FMT_F8, checked, out_features, in_features, in_features, bias, "f32")


def bind_bf16(packed, out_features, in_features, bias=None) -> BoundLinear:
    checked = _check_bf16("linear_bf16", packed, out_features, in_features)
    return BoundLinear("linear_bf16", _C.FMT_BF16, checked, out_features, in_features, in_features, bias, "f32")


def linear_int4(x, packed, out_features, in_features, group_size, bias=None, *, act="f32", out=None,
                num_threads=None) -> torch.Tensor:
    """y f32 [T, N] = x f32 [T, K] @ dequantize_int4(packed).T (+ bias f32 [N])."""
    return bind_int4(packed, out_features, in_features, group_size, bias, act)(x, out, num_threads)


def linear_int8(x, packed, out_features, in_features, group_size=None, bias=None, *, act="f32", out=None,
                num_threads=None) -> torch.Tensor:
    return bind_int8(packed, out_features, in_features, group_size, bias, act)(x, out, num_threads)


def linear_fp8(x, packed, out_features, in_features, bias=None, *, out=None, num_threads=None) -> torch.Tensor:
    return bind_fp8(packed, out_features, in_features, bias)(x, out, num_threads)


def linear_bf16(x, packed, out_features, in_features, bias=None, *, out=None, num_threads=None) -> torch.Tensor:
    return bind_bf16(packed, out_features, in_features, bias)(x, out, num_threads)


# ---------------------------------------------------------------------------------------------
# Executor entry points (runtime/kernels.py): bind once per node

_LAYOUTS = {"int4": LAYOUT_INT4, "int8": LAYOUT_INT8, "fp8": LAYOUT_FP8, "bf16": LAYOUT_BF16}


def _check_layout(attrs: dict) -> str:
    quant = attrs.get("quant")
    if quant not in _LAYOUTS:
        _fail("qlinear", f"quant {quant!r} is not one of {sorted(_LAYOUTS)}")
    if attrs.get("layout") != _LAYOUTS[quant]:
        _fail("qlinear", f"{quant} weights in layout {attrs.get('layout')!r}; this runtime reads "
                         f"{_LAYOUTS[quant]!r} (rebuild the engine)")
    return quant


def make_linear(attrs: dict, operands: dict[str, torch.Tensor], reuse: bool = False):
    """A callable x f32 [T, K] -> [T, N] for a linear/logits node; operands are the packed tensors (+ "bias").
    reuse keeps the output buffer while T stays the same (native_ops.Outputs)."""
    quant = _check_layout(attrs)
    n, k, g = attrs["out_features"], attrs["in_features"], attrs.get("group_size")
    bias, act = operands.get("bias"), attrs.get("act", "f32")
    if quant == "int4":
        bound = bind_int4(operands, n, k, g, bias, act)
    elif quant == "int8":
        bound = bind_int8(operands, n, k, g, bias, act)
    elif quant == "fp8":
        bound = bind_fp8(operands, n, k, bias)
    else:
        bound = bind_bf16(operands, n, k, bias)
    outputs = Outputs((n,), reuse)

    def run(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            unrecorded()  # the copy would not outlive the call: a tape cannot replay it
            x = x.contiguous()
        return bound(x, outputs.get(x)[0][0])

    return recordable(run)


def make_embedding_rows(attrs: dict, operands: dict[str, torch.Tensor]):
    """A callable tokens i64 [T] -> f32 [T, H] over a packed table [V, H] (attrs: vocab_size, hidden_size).

    Rows are dequantized in C with one rounding per element; ids outside the table are a
    ValueError before any row is read."""
    quant = _check_layout(attrs)
    v, h, g = attrs["vocab_size"], attrs.get("hidden_size", attrs.get("in_features")), attrs.get("group_size")
    bind = {"int4": lambda: bind_int4(operands, v, h, g), "int8": lambda: bind_int8(operands, v, h, g),
            "fp8": lambda: bind_fp8(operands, v, h), "bf16": lambda: bind_bf16(operands, v, h)}[quant]
    handle = bind().handle

    def rows(tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.is_contiguous():
            _fail("embedding", f"tokens must be a contiguous int64 [T], got {_describe(tokens)}")
        out = torch.empty((tokens.shape[0], h), dtype=torch.float32)
        _C.rows(handle, out.data_ptr(), tokens.data_ptr(), tokens.shape[0], torch.get_num_threads())
        return out

    return recordable(rows)
