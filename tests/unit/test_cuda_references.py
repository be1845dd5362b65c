"""Each cuda kernel's torch reference (kernels/references.py) against the kernel in Triton's interpreter, through
the CheckingLauncher that `engine-build verify` uses on a host without the engine's GPU: every kernel with a
reference, f32 and bf16, views with row strides, an fp8 cache, and a mutated kernel caught."""

import pytest
import torch
from conftest import mutated

from runtime.backends.cuda.checking import CheckingLauncher, KernelMismatch, ReferenceLauncher
from runtime.backends.cuda.kernels import attention, experts, gemm, rows, sampling
from runtime.backends.cuda.kernels.references import REFERENCES
from runtime.backends.cuda.launch import Kernel
from runtime.weights import fp8, int4

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def checked(run) -> CheckingLauncher:
    """run(launcher) under a CheckingLauncher; the launcher, after asserting it compared something."""
    launcher = CheckingLauncher()
    run(launcher)
    assert launcher.checked, "no launch was compared"
    return launcher


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels(dtype):
    wide = randn(5, 3 * 96, dtype=dtype)
    x = wide[:, 96:192]                                      # a column view: row stride 288
    weight = randn(96, seed=1).abs() + 0.5
    head_weight = randn(32, seed=2)
    launcher = checked(lambda ln: (rows.rms_norm(ln, x, weight, 1e-6),
                                   rows.head_rms_norm(ln, x, head_weight, 1e-6),
                                   rows.add_rms_norm(ln, x, randn(5, 96, seed=3, dtype=dtype), weight, 1e-5),
                                   rows.gated_act(ln, "silu", wide[:, :192]),
                                   rows.gated_act(ln, "gelu_tanh", x, randn(5, 96, seed=4, dtype=dtype))))
    names = {key.split(".")[0] for key in launcher.checked}
    assert names == {"_rms_norm_kernel", "_add_rms_norm_kernel", "_gated_act_kernel"}
    assert len(launcher.checked) == 5  # rms_norm at two widths, add_rms_norm, gated_act with two activations


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_and_apart(dtype):
    from runtime.ops.reference import RopeTable

    table = RopeTable(32, 10000.0, None)
    table.ensure(64)
    packed = table.packed[:64].contiguous()
    qkv = randn(6, (4 + 2 + 2) * 32, dtype=dtype)
    q, k = qkv[:, :128], qkv[:, 128:192]
    positions = torch.tensor([0, 1, 2, 9, 30, 63])
    checked(lambda ln: rows.rope(ln, q, k, positions, packed, 4, 2, 32))
    checked(lambda ln: rows.rope(ln, q, k, positions, packed, 4, 2, 32, out=(q, k)))


@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.bfloat16, torch.float8_e4m3fn)])
def test_kv_write_and_paged_attention(dtype, cache):
    nh, nkv, hd, bs = 6, 2, 32, 4
    scale = 1.0 if cache != torch.float8_e4m3fn else 0.05
    k_cache = torch.zeros(8, bs, nkv, hd).to(cache)
    v_cache = torch.zeros(8, bs, nkv, hd).to(cache)
    tables = torch.tensor([[3, 0, 5, -1], [6, 1, 2, 7]], dtype=torch.int32)
    q_lens, contexts = [5, 1], [11, 14]                       # a prefill chunk beside a decode
    qkv = randn(6, (nh + 2 * nkv) * hd, dtype=dtype)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    slots = torch.tensor([6 * bs + 3 - 4, 6 * bs + 3 - 3, 5 * bs + 0, 5 * bs + 1, 5 * bs + 2, 7 * bs + 1])
    for s, (ctx, n) in enumerate(zip(contexts, q_lens)):     # the earlier keys, written by the references
        past = torch.arange(ctx - n)
        where = tables[s, past // bs].long() * bs + past % bs
        ReferenceLauncher().launch(attention.kv_write_kernel, (len(past), nkv),
                                   (randn(len(past), nkv * hd, seed=s, dtype=dtype),
                                    randn(len(past), nkv * hd, seed=9 + s, dtype=dtype), k_cache, v_cache,
                                    where, nkv * hd, nkv * hd, nkv, scale),
                                   HEAD_DIM=hd, HEAD_DIM_PADDED=hd, QUANTIZED=cache == torch.float8_e4m3fn)
    slots = torch.tensor([tables[0, p // bs] * bs + p % bs for p in range(6, 11)] + [tables[1, 3] * bs + 1])
    out = torch.empty(6, nh * hd, dtype=dtype)
    for window in (0, 4):
        launcher = checked(lambda ln: (
            attention.kv_write(ln, k, v, k_cache, v_cache, slots, scale),
            attention.paged_attention(ln, out, q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32),
                                      torch.tensor([0, 5, 6], dtype=torch.int32), hd ** -0.5, num_heads=nh,
                                      kv_scale=scale, window=window, max_query_len=5)))
        assert {key.split(".")[0] for key in launcher.checked} == {"kv_write_kernel", "paged_attention_kernel"}
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [3, 20])                          # the GEMV and the GEMM
def test_int4_and_fp8_linears(dtype, t):
    w = randn(40, 128, seed=5)
    q, s, z = int4.quantize(w, 32)[:3]
    codes, fp8_scales = fp8.quantize(w, per_channel=False)[:2]
    x, bias = randn(t, 128, seed=6, dtype=dtype), randn(40, seed=7)
    launcher = checked(lambda ln: (gemm.linear_int4(ln, x, gemm.pack_int4(q), s, z, 32, bias),
                                   gemm.linear_fp8(ln, x, codes, fp8_scales.reshape(-1).float())))
    assert len(launcher.checked) == 2
    if t > gemm.GEMV_MAX_T:
        codes, per_channel = fp8.quantize(w)[:2]
        launcher = checked(lambda ln: gemm.linear_fp8(ln, x, codes, per_channel, bias, fp8_act=True))
        assert {key.split(".")[0] for key in launcher.checked} == {"fp8_quantize_rows", "fp8_gemm"}


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
def test_expert_gemv(fmt):
    w = randn(3, 40, 64, seed=8)
    if fmt == "float":
        weights = experts.Experts("float", w.to(torch.bfloat16))
    elif fmt == "int4":
        parts = [int4.quantize(w[e], 32)[:3] for e in range(3)]
        weights = experts.Experts("int4", torch.stack([gemm.pack_int4(p[0]) for p in parts]),
                                  torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts]), 32)
    else:
        parts = [fp8.quantize(w[e]) for e in range(3)]
        weights = experts.Experts("fp8", torch.stack([p[0] for p in parts]).view(torch.uint8),
                                  torch.stack([p[1].reshape(-1).expand(40) for p in parts]).contiguous())
    slots = torch.tensor([2, 0, -1, 2], dtype=torch.int32)
    checked(lambda ln: experts.expert_gemv(ln, randn(2, 64, seed=9, dtype=torch.bfloat16), slots, weights, 2))


def test_greedy_ties_to_the_lowest_id():
    logits = randn(3, 3000, seed=10)
    logits[1, 7] = logits[1, 2999] = 100.0
    ids = {}
    checked(lambda ln: ids.setdefault("out", sampling.greedy(ln, logits)))
    assert ids["out"].tolist() == logits.argmax(-1).tolist() and ids["out"][1] == 7


def test_every_kernel_but_the_sampling_ones_has_a_reference():
    kernels = {(k.module, k.name) for m in (attention, experts, gemm, rows, sampling)
               for k in vars(m).values() if isinstance(k, Kernel)}
    without = {name for _, name in kernels - set(REFERENCES)}
    assert without == {"_penalties_kernel", "_hold_back_kernel", "_sample_kernel"}
    assert set(REFERENCES) <= kernels  # none names a kernel that is not there


def test_the_grammar_mask_and_top_logprobs():
    logits = randn(3, 300, seed=13)
    bits = torch.tensor([[0x55555555, -1, 0, 0x0F0F0F0F, 7, -(2**31), 1, 3, 0, -1]], dtype=torch.int32)
    launcher = checked(lambda ln: (sampling.mask_bits(ln, logits, torch.tensor([1]), bits),
                                   sampling.top_logprobs(ln, logits, torch.tensor([0, 2, 4], dtype=torch.int32), 8)))
    assert {key.split(".")[0] for key in launcher.checked} == {"_mask_bits_kernel", "_top_logprobs_kernel"}
    assert bool(torch.isinf(logits[1]).any()) and not bool(torch.isinf(logits[[0, 2]]).any())


@pytest.mark.parametrize("module,name,old,new", [
    (rows, "_gated_act_kernel", "g / (1.0 + tl.exp(z)) * u", "g / (1.0 + tl.exp(z)) * g"),
    (gemm, "int4_gemv", "(q - 8.0) * s[:, None] + z[:, None]", "(q - 8.0) * s[:, None]"),
    (gemm, "fp8_gemv1", "((b & 0x7F) << 7)", "((b & 0x3F) << 7)"),  # the exponent's top bit lost
    (sampling, "_mask_bits_kernel", "& 1) != 0", "& 1) == 0"),
    (sampling, "_top_logprobs_kernel", "(offs > last_id)", "(offs >= last_id)"),
])
def test_a_mutated_kernel_is_caught(module, name, old, new, monkeypatch):
    monkeypatch.setattr(module, name, mutated(getattr(module, name), old, new))
    x = randn(2, 64, seed=11)
    with pytest.raises(KernelMismatch, match=name):
        if module is rows:
            rows.gated_act(CheckingLauncher(), "silu", x, x + 1)
        elif name == "_mask_bits_kernel":
            bits = torch.tensor([[0x00FF00FF, 5]], dtype=torch.int32)
            sampling.mask_bits(CheckingLauncher(), x, torch.tensor([1]), bits)
        elif name == "fp8_gemv1":
            q, s = fp8.quantize(randn(16, 64, seed=12), True)[:2]
            gemm.linear_fp8(CheckingLauncher(), x[:1], q, s)
        elif name == "_top_logprobs_kernel":  # the second pass finds the first again
            sampling.top_logprobs(CheckingLauncher(), x, torch.tensor([0, 1], dtype=torch.int32), 3)
        else:
            q, s, z = int4.quantize(randn(16, 64, seed=12), 32)[:3]
            gemm.linear_int4(CheckingLauncher(), x, gemm.pack_int4(q), s, z, 32)


def split_decode(launcher, dtype=torch.float32, window=0):
    """decode_attention over three sequences (300, 70 and 5 keys) in up to 6 splits of at least 32 keys."""
    nh, nkv, hd, bs = 4, 2, 16, 8
    k_cache, v_cache = randn(48, bs, nkv, hd, seed=20, dtype=dtype), randn(48, bs, nkv, hd, seed=21, dtype=dtype)
    tables = torch.randperm(48, generator=torch.Generator().manual_seed(22))[:3 * 16].view(3, 16).to(torch.int32)
    out = torch.zeros(3, nh * hd, dtype=dtype)
    attention.decode_attention(launcher, out, randn(3, nh * hd, seed=23, dtype=dtype), k_cache, v_cache, tables,
                               torch.tensor([300, 70, 5], dtype=torch.int32),
                               torch.tensor([0, 1, 2, 3], dtype=torch.int32), hd ** -0.5, num_heads=nh, splits=6,
                               window=window, min_keys=32)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_decode_attention(dtype):
    for window in (0, 100):
        launcher = checked(lambda ln: split_decode(ln, dtype, window))
        assert {key.split(".")[0] for key in launcher.checked} == {"paged_attention_split_kernel",
                                                                 "attention_merge_kernel"}


@pytest.mark.parametrize("name,old,new", [
    ("paged_attention_split_kernel", "key_end = tl.minimum(key_start + chunk, context_len)",
     "key_end = tl.minimum(key_start + chunk - 1, context_len)"),      # each split drops its last key
    ("attention_merge_kernel", "weight = tl.exp2(m - top)", "weight = tl.exp2(m - m)"),  # splits not rescaled
])
def test_a_mutated_split_attention_kernel_is_caught(name, old, new, monkeypatch):
    monkeypatch.setattr(attention, name, mutated(getattr(attention, name), old, new))
    with pytest.raises(KernelMismatch, match=name):
        split_decode(CheckingLauncher())


def rope_and_write(launcher, dtype=torch.float32, cache=torch.float32, kv_scale=1.0):
    """rope_kv_write on column slices of a fused qkv: 3 tokens (one skipped), GQA 4/2, head_dim 32."""
    from runtime.ops.reference import RopeTable

    nh, nkv, hd = 4, 2, 32
    table = RopeTable(hd, 10000.0, None)
    table.ensure(32)
    qkv = randn(3, (nh + 2 * nkv) * hd, seed=30, dtype=dtype)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    k_cache, v_cache = torch.zeros(4, 4, nkv, hd).to(cache), torch.zeros(4, 4, nkv, hd).to(cache)
    attention.rope_kv_write(launcher, q, k, v, k_cache, v_cache, torch.tensor([2, 9, 30]),
                            table.packed[:32].contiguous(), torch.tensor([7, -1, 12]), nh, kv_scale)
    return q, k_cache


@pytest.mark.parametrize("dtype,cache,kv_scale", [(torch.float32, torch.float32, 1.0),
                                                  (torch.bfloat16, torch.float8_e4m3fn, 0.05)])
def test_rope_kv_write(dtype, cache, kv_scale):
    launcher = checked(lambda ln: rope_and_write(ln, dtype, cache, kv_scale))
    assert {key.split(".")[0] for key in launcher.checked} == {"rope_kv_write_kernel"}


def test_a_mutated_rope_kv_write_is_caught(monkeypatch):
    monkeypatch.setattr(attention, "rope_kv_write_kernel", mutated(
        attention.rope_kv_write_kernel, "k2 = (x2 * cos + x1 * sin)", "k2 = (x2 * cos - x1 * sin)"))
    with pytest.raises(KernelMismatch, match="rope_kv_write_kernel"):
        rope_and_write(CheckingLauncher())
