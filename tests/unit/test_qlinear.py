"""Quantized linear kernels against a float64 reference of the dequantized weights.

Tolerances come from what the kernels do: act="f32" accumulates fp32 products in chains of at
most K + 2K/G terms, so |y - ref| <= gamma_n * sum|terms| with gamma_n = n * 2^-24 (plus one
rounding of each dequantized weight; AMX's f32 tiles add the 3 x 32 exact products of a 32-k
chunk from zero, then two terms a chunk: chains of 96 + 2K/32, within the same bound); act="int8"
adds the activation rounding, at most half an int8 step (block amax / 127) per element times |w|,
and act="int16" half an int16 step (amax / 32767), act="int12" half an int12 one (amax / 2047).
"""

import pytest
import torch

from runtime.ops import linear as ql
from runtime.weights import bf16 as bf16_weights
from runtime.weights import fp8 as fp8_weights
from runtime.weights import int4, int5, int6, int8

EPS32 = 2.0 ** -24
SMOLLM2 = {"q": (576, 576), "kv": (192, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ODD = {"n40_k96": (40, 96), "n17_k320": (17, 320), "n1_k384": (1, 384)}  # N % 16 != 0, K = G * odd
# each AVX2 direct width, AVX-512's widest direct ones (11, 12), then tiles (13 and more: AVX-512's MR = 12;
# AMX's f32 tiles of 16 tokens from 13: 13 and 17 end in a partial tile, 64 is four whole ones)
TOKENS = (1, 2, 3, 4, 8, 11, 12, 13, 17, 64)
LACKS = {"amx": "this CPU (or its OS) offers no AMX-INT8 tiles: the amx kernels cannot run here",
         "avx512": "this CPU lacks AVX-512 F/BW/DQ/VL/VNNI: the avx512 kernels cannot run here"}


def runs_here(name: str) -> bool:
    try:
        ql.set_isa(name)
        return True
    except ValueError:
        return False
    finally:
        ql.set_isa("auto")


ISAS = [name for name in ("amx", "avx512", "avx2", "portable") if runs_here(name)]  # those this CPU runs


@pytest.fixture(params=["amx", "avx512", "avx2", "portable"])
def isa(request):
    if request.param not in ISAS:
        pytest.skip(LACKS[request.param])
    ql.set_isa(request.param)
    yield request.param
    ql.set_isa("auto")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_int4(n, k, g, seed=0, f16=False):
    r = gen(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=r)
    s = torch.rand(n, k // g, generator=r) * 0.02 + 1e-4
    z = torch.randn(n, k // g, generator=r) * 0.02
    if f16:  # GGUF Q4_1: f16 d and m, zero = m + 8d in f32
        s, m = s.half().float(), (z - 8 * s).half().float()
        z = m + 8 * s
    return q, s, z


def random_int8(n, k, g, seed=0):
    r = gen(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=r)
    s = torch.rand((n,) if g is None else (n, k // g), generator=r) * 1e-3 + 1e-5
    return q, s


def random_int5(n, k, g, seed=0, f16=False):
    """q in 0..31, scales and mins (the value of code 0); f16: both f16 values (GGUF Q5_0 / Q5_1)."""
    r = gen(seed)
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=r)
    s = torch.rand(n, k // g, generator=r) * 0.02 + 1e-4
    m = -16 * s + torch.randn(n, k // g, generator=r) * 0.01
    return (q, s.half().float(), m.half().float()) if f16 else (q, s, m)


def random_int6(n, k, g, seed=0, f16=False):
    r = gen(seed)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=r)
    s = torch.rand(n, k // g, generator=r) * 0.02 + 1e-4
    return q, (s.half().float() if f16 else s)


# int5 and int6 (GGUF's Q5 and Q6 blocks): module, random operands, the groups GGUF uses, |terms| of a weight
GGUF_FORMATS = {
    "int5": (int5, random_int5, 32, lambda q, s, m: q.float() * s.abs() + m.abs()),
    "int6": (int6, random_int6, 16, lambda q, s: (q.float() - 32).abs() * s.abs()),
}


def check_f32(y, x, terms_w, ref, k, g):
    """Deterministic fp32 bound, and a typical (L2) relative error near fp32 epsilon."""
    bound = (k + 2 * k // g + 8) * EPS32 * magnitude(x, terms_w)
    err = (y.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3e}"
    assert err.norm() <= 2e-6 * ref.norm() + 1e-30


LEVELS = {"int8": 127, "int16": 32767, "int12": 2047}


def check_int_act(y, x, w, terms_w, ref, k, block, act="int8"):
    """|y - ref| <= sum_k |w| * step / 2 (activation rounding) + the fp32 bound."""
    t = x.shape[0]
    amax = x.double().abs().reshape(t, k // block, block).amax(-1)
    half_step = (amax / LEVELS[act] / 2).repeat_interleave(block, dim=1)  # [T, K]
    bound = magnitude(half_step, w.abs()) + (k + 8) * EPS32 * magnitude(x, terms_w)
    err = (y.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3e}"


def magnitude(x, terms_w):
    """|x| @ terms_w.T, a bound's scale: computed in f32 and padded by 1% (no need for f64 here)."""
    return (x.float().abs() @ terms_w.float().T).double() * 1.01


def int4_terms(q, s, z, g):
    """|q - 8| * s + |z| per weight: what the fp32 sums are made of (cancellation-aware)."""
    expand = lambda t: t.repeat_interleave(g, dim=1)  # noqa: E731
    return (q.float() - 8).abs() * expand(s).abs() + expand(z).abs()


def run_shapes(isa, all_smollm2=True):
    """The odd shapes and the SmolLM2 ones: all of them for the AVX-512 and AMX kernels' main cases,
    only q elsewhere (AVX2 shares the layouts and loop structure; portable C is slow)."""
    shapes = dict(ODD)
    shapes.update(SMOLLM2 if isa in ("amx", "avx512") and all_smollm2 else {"q": SMOLLM2["q"]})
    return shapes


# ---------------------------------------------------------------------------------------------
# Products against the reference


def per_batch(k, kernel, seed=0):
    """Runs kernel on batches of every size in TOKENS: (x [sum(TOKENS), K], outputs stacked the same way)."""
    x = torch.randn(sum(TOKENS), k, generator=gen(seed))
    starts = [sum(TOKENS[:i]) for i in range(len(TOKENS))]
    return x, torch.cat([kernel(x[a:a + t]) for a, t in zip(starts, TOKENS)])


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("act", ["f32", "int8", "int16", "int12"])
def test_int4_matches_reference(isa, g, act):
    for idx, (n, k) in enumerate(run_shapes(isa, g == 32).values()):
        if k % g:
            continue
        q, s, z = random_int4(n, k, g, seed=idx, f16=idx % 2 == 0)
        packed = int4.pack(q, s, z, g)
        w = int4.dequantize_packed(packed, n, k, g)
        bias = torch.randn(n, generator=gen(idx))
        x, y = per_batch(k, lambda xt: ql.linear_int4(xt, packed, n, k, g, bias, act=act), seed=idx)
        ref = x.double() @ w.double().T + bias.double()
        if act == "f32":
            check_f32(y, x, int4_terms(q, s, z, g), ref, k, g)
        else:
            check_int_act(y, x, w, int4_terms(q, s, z, g), ref, k, g, act)


@pytest.mark.parametrize("g", [None, 32])
@pytest.mark.parametrize("act", ["f32", "int8", "int16", "int12"])
def test_int8_matches_reference(isa, g, act):
    for idx, (n, k) in enumerate(run_shapes(isa, g == 32).values()):
        q, s = random_int8(n, k, g, seed=idx)
        packed = int8.pack(q, s, g)
        w = int8.dequantize_packed(packed, n, k, g)
        x, y = per_batch(k, lambda xt: ql.linear_int8(xt, packed, n, k, g, act=act), seed=idx)
        ref = x.double() @ w.double().T
        if act == "f32":
            check_f32(y, x, w.abs(), ref, k, g or k)
        else:
            block = g or next(b for b in (128, 64, 32) if k % b == 0)  # the kernels' per-channel choice
            check_int_act(y, x, w, w.abs(), ref, k, block, act)


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_int5_and_int6_match_reference(isa, name):
    fmt, random_operands, g, terms = GGUF_FORMATS[name]
    for idx, (n, k) in enumerate(run_shapes(isa).values()):
        operands = random_operands(n, k, g, seed=idx, f16=idx % 2 == 0)
        packed = fmt.pack(*operands, g)
        w = fmt.dequantize_packed(packed, n, k, g)
        bias = torch.randn(n, generator=gen(idx))
        x, y = per_batch(k, lambda xt: ql.bind(fmt.FORMAT, packed, n, k, g, bias)(xt), seed=idx)
        q, *per_group = operands
        terms_w = terms(q, *(t.repeat_interleave(g, dim=1) for t in per_group))
        check_f32(y, x, terms_w, x.double() @ w.double().T + bias.double(), k, g)


def test_fp8_and_bf16_match_reference(isa):
    for idx, (n, k) in enumerate(run_shapes(isa).values()):
        codes = (torch.randn(n, k, generator=gen(idx)) * 30).to(torch.float8_e4m3fn)
        fp8 = fp8_weights.pack(codes, torch.rand(n, generator=gen(idx)) + 0.01)
        bf16 = bf16_weights.pack(torch.randn(n, k, generator=gen(idx)))
        for packed, linear, w in ((fp8, ql.linear_fp8, fp8_weights.dequantize_packed(fp8, n, k)),
                                  (bf16, ql.linear_bf16, bf16_weights.dequantize_packed(bf16, n, k))):
            x, y = per_batch(k, lambda xt: linear(xt, packed, n, k), seed=idx)
            check_f32(y, x, w.abs(), x.double() @ w.double().T, k, k)


def test_fp8_decodes_every_finite_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(1, -1)[:, :248]  # 254 finite codes -> 248 (K % 8)
    packed = fp8_weights.pack(codes, torch.tensor([1.0]))
    expected = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(fp8_weights.dequantize_packed(packed, 1, 248), expected)
    x = torch.eye(248)
    assert torch.equal(ql.linear_fp8(x, packed, 1, 248)[:, 0], expected[0])  # one product each: exact


@pytest.mark.parametrize("simd,act", [(simd, act) for simd in ("amx", "avx512", "avx2") for act in ("int16", "int12", "int8")])
def test_integer_activations_are_the_portable_numbers_bit_for_bit(simd, act):
    """The SIMD kernels' integer modes share the portable quantization, block sums and integer dots:
    equal, not close. AMX takes int16 and int12 steps from 16 tokens and int8 ones from 32: 17, 40 and 70
    tokens fill whole tiles of 16 and a partial last one; int12 against q4 codes in blocks of 32 goes one tile
    row a block from 32 tokens (576 x 576 at 40 and 70), as int16 below that."""
    if simd not in ISAS:
        pytest.skip(LACKS[simd])
    # int8 per-channel (group None) takes activation blocks of 128 at K = 256, 64 at 320 and 32 at 96
    cases = [(int4, (40, 320, 64), True), (int4, (576, 576, 32), False), (int8, (33, 256, None), None),
             (int8, (24, 320, None), None), (int8, (40, 96, None), None), (int8, (40, 96, 32), None)]
    for fmt, (n, k, g), f16 in cases:
        packed = int4.pack(*random_int4(n, k, g, f16=f16), g) if fmt is int4 else int8.pack(*random_int8(n, k, g), g)
        linear = ql.linear_int4 if fmt is int4 else ql.linear_int8
        bias = torch.randn(n, generator=gen(n))
        for t in (1, 5, 17, 40, 70):
            x = torch.randn(t, k, generator=gen(t))
            x[0, :32] *= 1e3  # an outlier block
            ys = {}
            for name in (simd, "portable"):
                ql.set_isa(name)
                ys[name] = linear(x, packed, n, k, g, bias, act=act)
            ql.set_isa("auto")
            assert torch.equal(ys[simd], ys["portable"]), (fmt.__name__, n, k, g, t)


@pytest.mark.parametrize("act", ["f32", "int8", "int16", "int12"])
def test_a_step_longer_than_a_pass_gives_each_token_a_short_steps_numbers(isa, act):
    """A step of many tokens runs in passes of about 1 MiB of prepared activations (pass_tokens; at K = 1536:
    112 tokens for AMX's f32 tiles, 168 for the AVX-512 and AVX2 f32 tiles, 336 for int16 and int12, 672-680
    for int8): every token's outputs are those a step of 40 tokens gives it, on either side of a pass's end."""
    n, k, g = 32, 1536, 32
    packed = int4.pack(*random_int4(n, k, g), g)
    x = torch.randn(700, k, generator=gen(7))
    whole = ql.linear_int4(x, packed, n, k, g, act=act)
    for a in (0, 96, 150, 320, 660):
        assert torch.equal(whole[a:a + 40], ql.linear_int4(x[a:a + 40], packed, n, k, g, act=act)), a


def test_threads_give_identical_results():
    n, k, g = 576, 576, 32
    packed = int4.pack(*random_int4(n, k, g), g)
    for t in (1, 17):
        x = torch.randn(t, k, generator=gen(t))
        for act in ("f32", "int8", "int16", "int12"):
            one = ql.linear_int4(x, packed, n, k, g, act=act, num_threads=1)
            assert torch.equal(one, ql.linear_int4(x, packed, n, k, g, act=act, num_threads=2))


# ---------------------------------------------------------------------------------------------
# Packing


@pytest.mark.parametrize("f16", [True, False])
def test_int4_pack_round_trip_is_exact(f16):
    n, k, g = 40, 96, 32
    q, s, z = random_int4(n, k, g, f16=f16)
    packed = int4.pack(q, s, z, g)
    assert ("mins" in packed) == f16 and packed["scales"].dtype == (torch.float16 if f16 else torch.float32)
    assert packed["qweight"].shape == (3, k // 8, 64)
    q2, s2, z2 = int4.unpack(packed, n, k, g)
    assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(z2, z)
    expected = ((q.double() - 8) * s.double().repeat_interleave(g, 1) + z.double().repeat_interleave(g, 1)).float()
    assert torch.equal(int4.dequantize_packed(packed, n, k, g), expected)


@pytest.mark.parametrize("g", [None, 32])
def test_int8_pack_round_trip_is_exact(g):
    n, k = 33, 96
    q, s = random_int8(n, k, g)
    for scales in (s, s.half().float()):  # f32 kept as f32; f16-exact stored as f16
        packed = int8.pack(q, scales, g)
        assert packed["scales"].dtype == (torch.float16 if scales is not s else torch.float32)
        q2, s2 = int8.unpack(packed, n, k, g)
        assert torch.equal(q2, q) and torch.equal(s2, scales)


@pytest.mark.parametrize("name", GGUF_FORMATS)
@pytest.mark.parametrize("f16", [True, False])
def test_int5_and_int6_pack_round_trip_is_exact(name, f16):
    fmt, random_operands, g, _ = GGUF_FORMATS[name]
    n, k = 40, 96
    operands = random_operands(n, k, g, f16=f16)
    packed = fmt.pack(*operands, g)
    assert packed["qweight"].shape == (3, k // 8, 16 * fmt.BITS)  # 2 * bits bytes a k step of 16 rows
    assert all(packed[role].dtype == (torch.float16 if f16 else torch.float32) for role in fmt.FORMAT.roles[1:])
    assert all(torch.equal(a, b) for a, b in zip(fmt.unpack(packed, n, k, g), operands))
    assert torch.equal(fmt.dequantize_packed(packed, n, k, g), fmt.dequantize(*operands))
    q, (scales, *mins) = operands[0].double(), (t.double().repeat_interleave(g, 1) for t in operands[1:])
    expected = q * scales + mins[0] if mins else (q - 32) * scales  # float64: one f32 rounding away
    assert (fmt.dequantize(*operands).double() - expected).abs().max() <= 2 ** -24 * expected.abs().max()


def test_int5_dequantizes_as_one_fmaf():
    # 3 * s is a float32 tie (25 significant bits, the last one set) and m a tiny positive min: fmaf rounds
    # the exact sum up, while float64 first and float32 second would land on the tie and round it to even.
    s = torch.full((1, 1), 5592407 * 2.0 ** -24)
    m = torch.full((1, 1), 2.0 ** -60)
    q = torch.full((1, 32), 3, dtype=torch.uint8)
    twice_rounded = (3 * s.double() + m.double()).float()
    assert int5.dequantize(q, s, m)[0, 0] == torch.nextafter(twice_rounded, torch.tensor(2.0))[0, 0]
    packed = int5.pack(q, s, m, 32)
    rows = ql.bind_embedding({"quant": "int5", "layout": int5.LAYOUT, "vocab_size": 1, "hidden_size": 32,
                              "group_size": 32}, packed)
    assert torch.equal(rows(torch.tensor([0])), int5.dequantize(q, s, m))


def test_bf16_pack_round_trip_is_exact():
    w = torch.randn(17, 64).to(torch.bfloat16)
    assert torch.equal(bf16_weights.dequantize_packed(bf16_weights.pack(w), 17, 64), w.float())


# ---------------------------------------------------------------------------------------------
# Adversarial inputs


@pytest.mark.parametrize("act", ["f32", "int8", "int16", "int12"])
def test_outliers_and_zero_scales(isa, act):
    n, k, g = 40, 192, 32
    q, s, z = random_int4(n, k, g, seed=5)
    s[3] = 0.0           # row 3: zero scales, w = z
    s[4], z[4] = 0.0, 0.0  # row 4: all zero
    s[7] *= 1e4          # outlier row
    z[:, 2] = -8 * s[:, 2]  # group 2 symmetric (zero point cancels)
    packed = int4.pack(q, s, z, g)
    w = int4.dequantize_packed(packed, n, k, g)
    x = torch.randn(5, k, generator=gen(9))
    x[:, 11] *= 1e4      # outlier channel
    x[2] = 0.0           # an all-zero token (int8 step 0)
    x[3, :32] = 0.0      # an all-zero block
    y = ql.linear_int4(x, packed, n, k, g, act=act)
    assert bool(torch.isfinite(y).all()) and bool((y[:, 4] == 0).all()) and bool((y[2] == 0).all())
    ref = x.double() @ w.double().T
    terms = int4_terms(q, s, z, g)
    if act == "f32":
        bound = (k + 2 * k // g + 8) * EPS32 * magnitude(x, terms)
        assert bool(((y.double() - ref).abs() <= bound).all())
    else:
        check_int_act(y, x, w, terms, ref, k, g, act)


def test_empty_batch_and_out_argument():
    n, k, g = 40, 96, 32
    packed = int4.pack(*random_int4(n, k, g), g)
    assert ql.linear_int4(torch.empty(0, k), packed, n, k, g).shape == (0, n)
    out = torch.full((2, n), float("nan"))
    x = torch.randn(2, k)
    assert ql.linear_int4(x, packed, n, k, g, out=out) is out
    torch.testing.assert_close(out, x @ int4.dequantize_packed(packed, n, k, g).T, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Executor entry points


def test_make_linear_and_embedding_rows():
    n, k, g = 40, 96, 32
    q, s = random_int8(n, k, g)
    packed = int8.pack(q, s, g)
    w = int8.dequantize_packed(packed, n, k, g)
    bias = torch.randn(n)
    attrs = {"quant": "int8", "layout": int8.LAYOUT, "out_features": n, "in_features": k, "group_size": g}
    fn = ql.bind_linear(attrs, dict(packed, bias=bias))
    x = torch.randn(6, 2 * k)[:, ::2]  # non-contiguous activations are made contiguous
    torch.testing.assert_close(fn(x), x @ w.T + bias, rtol=1e-5, atol=1e-5)
    rows = ql.bind_embedding(dict(attrs, vocab_size=n, hidden_size=k), packed)
    ids = torch.tensor([0, 39, 17, 17])
    assert torch.equal(rows(ids), w[ids])
    q4 = int4.pack(*random_int4(n, k, g, f16=True), g)
    rows4 = ql.bind_embedding({"quant": "int4", "layout": int4.LAYOUT, "vocab_size": n, "hidden_size": k,
                                    "group_size": g}, q4)
    assert torch.equal(rows4(ids), int4.dequantize_packed(q4, n, k, g)[ids])
    many = torch.randint(0, n, (1000,), generator=gen(3))  # enough rows to run threaded
    assert torch.equal(rows4(many), int4.dequantize_packed(q4, n, k, g)[many])
    for name, (fmt, random_operands, group, _) in GGUF_FORMATS.items():  # the kernels' own fma / product
        for f16 in (True, False):
            operands = random_operands(n, k, group, f16=f16)
            table = ql.bind_embedding({"quant": name, "layout": fmt.LAYOUT, "vocab_size": n, "hidden_size": k,
                                       "group_size": group}, fmt.pack(*operands, group))
            assert torch.equal(table(many), fmt.dequantize(*operands)[many]), (name, f16)
    with pytest.raises(ValueError, match="id 40 at 1 is outside 0..39"):
        rows(torch.tensor([3, 40]))
    with pytest.raises(ValueError, match="tokens must be a contiguous int64"):
        rows(torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="layout"):
        ql.bind_linear(dict(attrs, layout="q8.other"), packed)


# ---------------------------------------------------------------------------------------------
# Errors: raised by the wrapper before any pointer is touched


def test_wrapper_errors():
    n, k, g = 40, 96, 32
    q, s, z = random_int4(n, k, g)
    packed = int4.pack(q, s, z, g)
    q5, q6 = int5.pack(q, s, z, g), int6.pack(q, s.repeat_interleave(2, 1), 16)
    x = torch.randn(2, k)
    cases = [
        (lambda: int4.pack(q.to(torch.int8), s, z, g), "q must be"),
        (lambda: int4.pack(q, s.double(), z, g), "scales must be"),
        (lambda: int4.pack(q, s[:, :2], z, g), "scales must be"),
        (lambda: int4.pack(q[:, :80], s, z, 64), "not divisible"),
        (lambda: int4.pack(q, s, z, 48), "group_size"),
        (lambda: int4.pack(q | 16, s, z, g), "0..15"),
        (lambda: int8.pack(q.to(torch.int8), s[:, :2].contiguous(), g), "scales must be"),
        (lambda: int8.pack(q.to(torch.int8), torch.rand(n, 2), None), "scales must be"),
        (lambda: fp8_weights.pack(torch.full((2, 8), 0x7F, dtype=torch.uint8), torch.ones(2)), "NaN"),
        (lambda: ql.linear_int4(x.double(), packed, n, k, g), "x must be"),
        (lambda: ql.linear_int4(x.bfloat16(), packed, n, k, g), "x must be"),
        (lambda: ql.linear_int4(torch.randn(2, 2 * k)[:, ::2], packed, n, k, g), "x must be"),
        (lambda: ql.linear_int4(torch.randn(2, 64), packed, n, k, g), "x must be"),
        (lambda: ql.linear_int4(x, packed, n, k, 64), "not divisible"),
        (lambda: ql.linear_int4(x, dict(packed, scales=packed["scales"][:, :2].contiguous()), n, k, g), "scales must"),
        (lambda: ql.linear_int4(x, packed, n + 16, k, g), "qweight must be"),
        (lambda: ql.linear_int4(x, {"qweight": packed["qweight"]}, n, k, g), "lack 'scales'"),
        (lambda: ql.linear_int4(x, dict(packed, scales=packed["scales"].half()), n, k, g), "f16 scales"),
        (lambda: ql.linear_int4(x, packed, n, k, g, bias=torch.randn(n + 1)), "bias must be"),
        (lambda: ql.linear_int4(x, packed, n, k, g, act="int4"), "act must be"),
        (lambda: ql.linear_int4(x, packed, n, k, g, out=torch.empty(2, n + 1)), "out must be"),
        (lambda: ql.linear_int8(torch.randn(2, 40), int8.pack(torch.zeros(8, 40, dtype=torch.int8),
                                                                  torch.ones(8)), 8, 40, act="int8"), "int8"),
        (lambda: int5.pack(q | 32, s, z, g), "0..31"),
        (lambda: int5.pack(q, s, z, 16), "group_size"),
        (lambda: int5.pack(q, s, z[:, :2], g), "mins must be"),
        (lambda: int6.pack(q | 64, s, g), "0..63"),
        (lambda: int6.pack(q, s, 48), "group_size"),
        (lambda: ql.bind(int5.FORMAT, {"qweight": q5["qweight"], "scales": q5["scales"]}, n, k, g), "lack 'mins'"),
        (lambda: ql.bind(int5.FORMAT, dict(q5, mins=q5["mins"].half()), n, k, g), "one dtype"),
        (lambda: ql.bind(int6.FORMAT, q6, n, k, 32), "scales must be"),
        (lambda: ql.bind(int6.FORMAT, q6, n + 16, k, 16), "qweight must be"),
        (lambda: ql.BoundLinear("linear_int6", int6.FORMAT.kernel, int6.check_packed("linear_int6", q6, n, k, 16),
                                n, k, 16, None, "int16"), "int4/int8 weights"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()
