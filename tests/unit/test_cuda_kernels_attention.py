"""The cuda backend's Triton attention kernels (kv_write, paged_attention) under Triton's interpreter, against
the C kernels of runtime.ops.attention reading the same caches, and the variants the build would record."""

import pytest
import torch

from runtime.backends.cuda.kernels import attention as gpu
from runtime.backends.cuda.launch import InterpreterLauncher, RecordingLauncher
from runtime.ops import attention as native
from runtime.ops import reference

# f32 activations: both sides sum the same f32 products in another order, so 1e-5 absolute.
F32_TOL = 1e-5


def low_precision_tol(dtype: torch.dtype, v: torch.Tensor) -> float:
    """f16/bf16 activations round p before p @ v and round the output, each a relative eps / 2: the output
    moves by at most about eps * max|v| (eps = 2^-10 for f16, 2^-7 for bf16); twice that for slack."""
    return 2 * torch.finfo(dtype).eps * v.abs().max().item()


def fill_nan(shape, dtype) -> torch.Tensor:
    """A cache whose every unwritten slot is NaN, so a read of a slot the kernel must skip shows in the output."""
    return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)


def make_step(ctx_and_qlen, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, kv_scale=1.0, seed=0):
    """A step over sequences given as (context_len, query_len), their K/V written through the C kv_write into
    shuffled blocks. Returns q [T, nh * hd] f32, caches, block_tables, context_lens, query_start_loc, and the
    per-sequence K/V [ctx, nkv * hd] f32 as stored."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in ctx_and_qlen]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = fill_nan(shape, cache_dtype), fill_nan(shape, cache_dtype)
    block_tables = torch.full((len(ctx_and_qlen), width), 0, dtype=torch.int32)
    kv, slots = [], []
    for s, (ctx, _) in enumerate(ctx_and_qlen):
        for b in range(blocks_per_seq[s]):
            block_tables[s, b] = order.pop()
        pos = torch.arange(ctx)
        slots.append(block_tables[s, pos // block_size].long() * block_size + pos % block_size)
        kv.append((torch.randn(ctx, num_kv_heads, head_dim, generator=g),
                   torch.randn(ctx, num_kv_heads, head_dim, generator=g)))
    native.kv_write(torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), k_cache, v_cache,
                    torch.cat(slots), kv_scale=kv_scale)
    qlens = [q for _, q in ctx_and_qlen]
    q = torch.randn(sum(qlens), num_heads * head_dim, generator=g)
    context_lens = torch.tensor([c for c, _ in ctx_and_qlen], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens, query_start_loc, kv


def run_both(step, num_heads, act_dtype=torch.float32, kv_scale=1.0, window=0):
    """(Triton output as f32, C output f32) for one step; C reads the same caches with q rounded to act_dtype."""
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, _ = step
    q = q.to(act_dtype)
    head_dim = k_cache.shape[3]
    scale = head_dim ** -0.5
    qlens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    out = torch.empty_like(q)
    gpu.paged_attention(InterpreterLauncher(), out, q, k_cache, v_cache, block_tables, context_lens,
                        query_start_loc, scale, num_heads=num_heads, kv_scale=kv_scale, window=window,
                        max_query_len=max(qlens))
    expected = torch.empty(q.shape[0], num_heads, head_dim)
    native.paged_attention(expected, q.float().reshape(q.shape[0], num_heads, head_dim), k_cache, v_cache,
                           block_tables, context_lens, query_start_loc, scale, kv_scale=kv_scale, window=window)
    return out.float(), expected.reshape(q.shape[0], -1)


# ---------------------------------------------------------------------------------------- kv_write

@pytest.mark.parametrize("cache_dtype, kv_scale", [(torch.float32, 1.0), (torch.float16, 1.0),
                                                    (torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.0625)])
def test_kv_write_matches_native_bits(cache_dtype, kv_scale):
    """Bit-exact against the C kv_write, with two exceptions of the interpreter, not of the GPU: it truncates
    f32 -> bf16 (so one bf16 ulp), and its f32 -> fp8 rounding loses some carries into the exponent, so the fp8
    case writes values that need no rounding (fp8 values times kv_scale = 2^-4) plus values beyond
    448 * kv_scale that must saturate. k and v are column slices of a fused qkv, so their rows are strided."""
    num_kv_heads, head_dim, block_size, num_blocks = 2, 24, 4, 5
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 * num_kv_heads) * head_dim, generator=g) * 8  # [T, (nh + 2 nkv) * hd]
    if cache_dtype == torch.float8_e4m3fn:
        qkv = (qkv / kv_scale).to(cache_dtype).float() * kv_scale
        qkv[:, ::7] = 60.0 * torch.sign(qkv[:, ::7])  # 960 before scaling: saturates to +-448
    width = num_kv_heads * head_dim
    k, v = qkv[:, 4 * head_dim:4 * head_dim + width], qkv[:, 4 * head_dim + width:]
    slot_mapping = torch.tensor([3, -1, 17, 0, 9, -1, 19], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = fill_nan(shape, cache_dtype), fill_nan(shape, cache_dtype)
    gpu.kv_write(InterpreterLauncher(), k, v, k_cache, v_cache, slot_mapping, kv_scale)
    k_ref, v_ref = fill_nan(shape, cache_dtype), fill_nan(shape, cache_dtype)
    native.kv_write(k.reshape(7, num_kv_heads, head_dim).contiguous(), v.reshape(7, num_kv_heads, head_dim).contiguous(),
                    k_ref, v_ref, slot_mapping.long(), kv_scale=kv_scale)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        if cache_dtype == torch.bfloat16:
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0, equal_nan=True)
        else:  # bit patterns, so that NaN == NaN in unwritten slots
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------------------------------- paged_attention

# A prefill chunk of 11 queries after a cached prefix of 9 (two query tiles), two decodes, a fresh one-token prompt.
MIXED = [(20, 11), (13, 1), (6, 1), (1, 1)]


def test_mixed_prefill_and_decode_gqa_f32():
    step = make_step(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, cache_dtype=torch.float32)
    out, expected = run_both(step, num_heads=4)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)
    # The prefill chunk against the dense reference as well (tolerance F32_TOL).
    q, _, _, _, _, _, kv = step
    k, v = kv[0]
    dense = reference.dense_causal_attention(q[:11], k.reshape(20, -1), v.reshape(20, -1),
                                             {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "scale": 32 ** -0.5})
    torch.testing.assert_close(out[:11], dense, atol=F32_TOL, rtol=0)


def test_mqa_and_head_dim_not_a_power_of_two():
    """6 query heads on one kv head (a group of 6: rows of a tile padded to 16) with head_dim 80 padded to 128."""
    step = make_step(MIXED, num_heads=6, num_kv_heads=1, head_dim=80, block_size=8, cache_dtype=torch.float32)
    out, expected = run_both(step, num_heads=6)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)


def test_sliding_window_never_reads_blocks_given_back():
    """Blocks wholly before the window of a sequence's first query are -1 in the table and NaN in the cache: a
    read of either shows as NaN. Contexts past 32 + window make the kernel skip whole 32-key tiles. F32_TOL."""
    window, block_size = 5, 4
    steps = [(45, 6), (40, 1), (9, 1)]
    step = make_step(steps, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size,
                     cache_dtype=torch.float32)
    _, k_cache, v_cache, block_tables, _, _, _ = step
    for s, (ctx, qlen) in enumerate(steps):
        first_visible = max(ctx - qlen - window + 1, 0)
        for b in range(first_visible // block_size):
            k_cache[block_tables[s, b]] = float("nan")
            v_cache[block_tables[s, b]] = float("nan")
            block_tables[s, b] = -1
    assert (block_tables == -1).sum() >= 16
    out, expected = run_both(step, num_heads=4, window=window)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_activations_and_cache(dtype):
    """f16/bf16 q, out and caches; C reads the same caches with the same rounded q (tolerance low_precision_tol;
    under the interpreter bf16 roundings truncate, up to eps rather than eps / 2, still within it)."""
    step = make_step(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, cache_dtype=dtype, seed=1)
    out, expected = run_both(step, num_heads=4, act_dtype=dtype)
    v_cache = step[2]
    tol = low_precision_tol(dtype, v_cache.float().nan_to_num())
    torch.testing.assert_close(out, expected, atol=tol, rtol=0)


def test_fp8_cache_with_kv_scale():
    """Both sides dequantize the same fp8 bytes as byte * kv_scale in f32, so F32_TOL with f32 activations."""
    step = make_step(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                     cache_dtype=torch.float8_e4m3fn, kv_scale=0.02, seed=2)
    out, expected = run_both(step, num_heads=4, kv_scale=0.02)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)


# ---------------------------------------------------------------------------------------- variants

def test_variants_do_not_depend_on_token_count():
    """A decode step and a prefill step of one model record the same paged_attention and kv_write variants: the
    build compiles one of each per model (and cache/activation dtype), whatever the batch."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    meta = torch.device("meta")
    k_cache = torch.empty(64, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=meta)
    v_cache = torch.empty_like(k_cache)
    keys = []
    for num_seqs, tokens, max_query_len in ((5, 5, 1), (2, 300, 250)):
        launcher = RecordingLauncher()
        i32 = {"dtype": torch.int32, "device": meta}
        qkv = torch.empty(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, device=meta)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
        gpu.kv_write(launcher, k, v, k_cache, v_cache, torch.empty(tokens, **i32))
        gpu.paged_attention(launcher, torch.empty(q.shape, dtype=q.dtype, device=meta), q, k_cache, v_cache,
                            torch.empty(num_seqs, 20, **i32), torch.empty(num_seqs, **i32),
                            torch.empty(num_seqs + 1, **i32), 0.125, num_heads=num_heads, window=0,
                            max_query_len=max_query_len)
        keys.append(sorted(launcher.seen))
    assert len(keys[0]) == 2 and keys[0] == keys[1]


# ---------------------------------------------------------------------------------------- split decode attention

def run_split(step, num_heads, splits, min_keys, act_dtype=torch.float32, kv_scale=1.0, window=0):
    """(decode_attention's output as f32, the C kernel's f32) for a step of one query a sequence."""
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, _ = step
    q = q.to(act_dtype)
    scale = k_cache.shape[3] ** -0.5
    out = torch.zeros_like(q)
    gpu.decode_attention(InterpreterLauncher(), out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                         scale, num_heads=num_heads, splits=splits, kv_scale=kv_scale, window=window,
                         min_keys=min_keys)
    expected = torch.empty(q.shape[0], num_heads, k_cache.shape[3])
    native.paged_attention(expected, q.float().reshape(q.shape[0], num_heads, -1), k_cache, v_cache, block_tables,
                           context_lens, query_start_loc, scale, kv_scale=kv_scale, window=window)
    return out.float(), expected.reshape(q.shape[0], -1)


# Decodes of contexts from one key to several splits' worth: 1 and 33 keys need one split of 32, 100 four, 300 all.
DECODES = [(300, 1), (1, 1), (100, 1), (33, 1), (7, 1)]


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_decode_attention_equals_the_one_program_kernel(splits):
    """Each sequence's keys split over up to `splits` programs (32 keys at the least), merged: the C kernel's
    output within F32_TOL, GQA group of 3 (rows padded to 16)."""
    step = make_step(DECODES, num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, cache_dtype=torch.float32)
    out, expected = run_split(step, num_heads=6, splits=splits, min_keys=32)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)


def test_split_decode_attention_with_a_window_fp8_and_bf16():
    """A sliding window whose earlier blocks were given back (-1 and NaN in the cache), an fp8 cache with its
    scale, bf16 activations: each against the C kernel on the same caches."""
    window, block_size = 40, 4
    steps = [(200, 1), (45, 1), (9, 1)]
    step = make_step(steps, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size,
                     cache_dtype=torch.float32, seed=3)
    _, k_cache, v_cache, block_tables, _, _, _ = step
    for s, (ctx, _) in enumerate(steps):
        for b in range(max(ctx - window, 0) // block_size):
            k_cache[block_tables[s, b]] = v_cache[block_tables[s, b]] = float("nan")
            block_tables[s, b] = -1
    out, expected = run_split(step, num_heads=4, splits=4, min_keys=16, window=window)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)

    fp8 = make_step(DECODES, num_heads=4, num_kv_heads=1, head_dim=32, block_size=16,
                    cache_dtype=torch.float8_e4m3fn, kv_scale=0.02, seed=4)
    out, expected = run_split(fp8, num_heads=4, splits=5, min_keys=32, kv_scale=0.02)
    torch.testing.assert_close(out, expected, atol=F32_TOL, rtol=0)

    low = make_step(DECODES, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, cache_dtype=torch.bfloat16,
                    seed=5)
    out, expected = run_split(low, num_heads=4, splits=8, min_keys=32, act_dtype=torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=low_precision_tol(torch.bfloat16, low[2].float().nan_to_num()), rtol=0)


def test_split_decode_leaves_a_batch_slot_without_a_query_and_zeroes_one_without_keys():
    """Graph padding: a slot whose query_start_loc does not advance is not written; a context of 0 gives 0."""
    q, k_cache, v_cache, tables, ctx, _, _ = make_step([(50, 1), (20, 1)], num_heads=2, num_kv_heads=1,
                                                       head_dim=16, block_size=4, cache_dtype=torch.float32)
    ctx = torch.tensor([50, 20, 0], dtype=torch.int32)
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32)  # the second sequence has no query; the third's context 0
    out = torch.full_like(q, 7.0)
    gpu.decode_attention(InterpreterLauncher(), out, q, k_cache, v_cache, tables, ctx, qsl, 0.25, num_heads=2,
                         splits=4, min_keys=16)
    expected = torch.empty(1, 2, 16)
    native.paged_attention(expected, q[:1].reshape(1, 2, 16), k_cache, v_cache, tables[:1], ctx[:1], qsl[:2], 0.25)
    torch.testing.assert_close(out[0], expected.reshape(-1), atol=F32_TOL, rtol=0)
    assert torch.equal(out[1], torch.zeros(32))


def test_decode_splits_fill_the_multiprocessors_and_share_one_variant():
    """Two programs a multiprocessor, at most MAX_SPLITS; the split count is not part of any variant."""
    assert gpu.decode_splits(1, 8, 132) == 32 and gpu.decode_splits(4, 8, 132) == 9
    assert gpu.decode_splits(256, 8, 132) == 1 and gpu.decode_splits(1, 1, 2) == 4
    meta = torch.device("meta")
    k_cache = torch.empty(64, 16, 2, 64, dtype=torch.bfloat16, device=meta)
    keys = []
    for seqs, splits in ((1, 32), (64, 2)):
        launcher = RecordingLauncher()
        i32 = {"dtype": torch.int32, "device": meta}
        q = torch.empty(seqs, 8 * 64, dtype=torch.bfloat16, device=meta)
        gpu.decode_attention(launcher, torch.empty_like(q), q, k_cache, torch.empty_like(k_cache),
                             torch.empty(seqs, 4, **i32), torch.empty(seqs, **i32), torch.empty(seqs + 1, **i32),
                             0.125, num_heads=8, splits=splits)
        keys.append(sorted(launcher.seen))
    assert keys[0] == keys[1] and len(keys[0]) == 2


# ---------------------------------------------------------------------------------------- rope + kv write

@pytest.mark.parametrize("dtype, cache, kv_scale", [(torch.float32, torch.float32, 1.0),
                                                    (torch.bfloat16, torch.bfloat16, 1.0),
                                                    (torch.bfloat16, torch.float8_e4m3fn, 0.05)])
def test_rope_kv_write_equals_rope_then_kv_write(dtype, cache, kv_scale):
    """One launch against the two it replaces, on column slices of a fused qkv (rows strided), head_dim 96 (a
    half of 48, padded), GQA 6/2, one token's slot -1: the same q, the same cache bytes, k left as it was."""
    from runtime.backends.cuda.kernels import rows
    from runtime.ops.reference import RopeTable

    nh, nkv, hd, t = 6, 2, 96, 5
    g = torch.Generator().manual_seed(9)
    table = RopeTable(hd, 10000.0, None)
    table.ensure(64)
    table = table.packed[:64].contiguous()
    positions = torch.tensor([3, 17, 0, 40, 8])
    slots = torch.tensor([5, 0, -1, 13, 2])
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    fused, apart = qkv.clone(), qkv.clone()
    caches = [[torch.zeros(4, 4, nkv, hd).to(cache) for _ in range(2)] for _ in range(2)]
    q, k, v = fused.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    gpu.rope_kv_write(InterpreterLauncher(), q, k, v, *caches[0], positions, table, slots, nh, kv_scale)
    q2, k2, v2 = apart.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q2r, k2r = rows.rope(InterpreterLauncher(), q2, k2, positions, table, nh, nkv, hd)
    gpu.kv_write(InterpreterLauncher(), k2r, v2, *caches[1], slots, kv_scale)
    assert torch.equal(q, q2r) and torch.equal(k, qkv[:, nh * hd:(nh + nkv) * hd])
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert bool(caches[0][0].float().abs().sum() > 0)
