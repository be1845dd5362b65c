"""Native paged attention and KV write against a float64 torch reference, plus the wrapper's checks."""

import math

import pytest
import torch

from runtime.ops import reference, rowops
from runtime.ops.attention import kv_write, paged_attention, qkv_attention

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
QUANT_SCALE = {torch.int8: 0.03, torch.float8_e4m3fn: 0.01}  # kv_scale per quantized cache dtype

# (context_len, query_len) per sequence: fresh prompts, prefill chunks after a cached prefix,
# decode tokens, an idle sequence, and contexts spanning several of the kernel's 32-key chunks.
MIXED_STEP = [(1, 1), (37, 37), (50, 13), (100, 1), (17, 1), (150, 70), (5, 0)]


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """The reference's tensors are tiny: torch threads only add OpenMP wake-ups (and spinning on a
    loaded CI machine). The kernel still runs on two threads, passed explicitly."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------- reference

def dequantize(cache: torch.Tensor, kv_scale: float) -> torch.Tensor:
    return cache.to(torch.float64) * kv_scale


def reference_paged_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                              kv_scale=1.0, window=0):
    """Gather each sequence's K/V through its block table and attend causally (within the last
    `window` positions when window > 0), in float64: [T, nh, hd]."""
    num_heads, block_size, num_kv_heads = query.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_slots, nkv, hd]
    for s, ctx in enumerate(context_lens.tolist()):
        q0, q1 = query_start_loc[s].item(), query_start_loc[s + 1].item()
        if q1 == q0:
            continue
        pos = torch.arange(ctx)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = dequantize(k_flat[slots], kv_scale).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = dequantize(v_flat[slots], kv_scale).repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale  # [nh, qlen, ctx]
        query_pos = ctx - (q1 - q0) + torch.arange(q1 - q0)
        scores.masked_fill_(pos[None, :] > query_pos[:, None], float("-inf"))
        if window:
            scores.masked_fill_(pos[None, :] <= query_pos[:, None] - window, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.float()


def quantize_like_cache(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """What kv_write must store for float32 x in a cache of dtype."""
    if dtype == torch.int8:
        return torch.clamp(torch.round(x / kv_scale), -127, 127).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return torch.clamp(x / kv_scale, -448, 448).to(torch.float8_e4m3fn)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------- step builder

def garbage_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype) -> torch.Tensor:
    """A cache whose unwritten slots poison any read of them (NaN, or the int8 extreme)."""
    fill = 127 if dtype == torch.int8 else float("nan")
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)


def build_step(seqs, block_size, num_kv_heads, head_dim, dtype, generator):
    """Caches holding every sequence's context in shuffled blocks, and the step's metadata."""
    blocks_per_seq = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    k_cache = garbage_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = garbage_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    kv_scale = QUANT_SCALE.get(dtype, 1.0)
    next_block = 0
    for s, (ctx, _) in enumerate(seqs):
        table = block_ids[next_block:next_block + blocks_per_seq[s]]
        block_tables[s, :len(table)] = table
        next_block += len(table)
        pos = torch.arange(ctx)
        slots = table[pos // block_size].long() * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            values = torch.randn(ctx, num_kv_heads, head_dim, generator=generator)
            cache.flatten(0, 1)[slots] = quantize_like_cache(values, dtype, kv_scale)
    query_lens = torch.tensor([qlen for _, qlen in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    context_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
    return k_cache, v_cache, block_tables, context_lens, query_start_loc, kv_scale


def run_both(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, num_threads=2, window=0):
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step(seqs, block_size, num_kv_heads, head_dim,
                                                              dtype, generator)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=generator)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    paged_attention(out, query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale=kv_scale,
                    window=window, num_threads=num_threads)
    expected = reference_paged_attention(query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale, window)
    return out, expected


# ---------------------------------------------------------------------------------------- attention

# Every pair of (GQA ratio, head_dim, block_size) values appears at least once.
PAIRWISE_SHAPES = [(1, 64, 1), (1, 48, 8), (1, 64, 16), (3, 48, 1), (3, 64, 8), (3, 48, 16),
                   (4, 48, 1), (4, 64, 8), (4, 48, 16)]


@pytest.mark.parametrize("ratio, head_dim, block_size", PAIRWISE_SHAPES)
def test_mixed_step_matches_reference_f32(ratio, head_dim, block_size):
    out, expected = run_both(MIXED_STEP, 2 * ratio, 2, head_dim, block_size, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", CACHE_DTYPES[1:], ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_low_precision_caches_read_exactly(dtype, block_size):
    # The reference reads the same stored elements, so only the arithmetic differs.
    out, expected = run_both(MIXED_STEP, 9, 3, 64, block_size, dtype, seed=1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_head_dim_not_multiple_of_eight():
    out, expected = run_both([(30, 30), (41, 1), (9, 4)], 6, 2, 20, 8, torch.bfloat16, seed=2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_many_heads_per_kv_head_and_long_prefill():
    out, expected = run_both([(300, 300), (200, 1)], 40, 1, 32, 16, torch.float32, seed=3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# Windows shorter than one 32-key chunk, across chunk boundaries, equal to a context, and longer than all.
@pytest.mark.parametrize("window", [1, 7, 32, 45, 70, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_sliding_window_matches_reference(window, dtype):
    out, expected = run_both(MIXED_STEP, 9, 3, 64, 16, dtype, seed=5, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_on_the_general_path_and_odd_head_dim():
    out, expected = run_both([(90, 90), (75, 1), (40, 33)], 6, 2, 20, 8, torch.float32, seed=6, window=19)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("ratio, head_dim, context, window", [(1, 64, 37, 0), (3, 64, 100, 0), (4, 40, 64, 0),
                                                              (8, 48, 71, 0), (3, 64, 100, 45), (1, 64, 37, 3)])
def test_decoded_query_equals_the_last_query_of_a_prefill_chunk(dtype, ratio, head_dim, context, window):
    # A lone query (every decode step) takes the kernel's single-query path, which reads each key once
    # for all the heads of its kv head; the last query of a chunk of six takes the general path. They
    # must agree bit for bit, or greedy outputs would depend on how the scheduler chunked a prompt.
    generator = torch.Generator().manual_seed(context)
    k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step([(context, 6)], 16, 2, head_dim, dtype, generator)
    query = torch.randn(6, 2 * ratio, head_dim, generator=generator)
    scale = 1.0 / math.sqrt(head_dim)
    chunk, alone = torch.empty_like(query), torch.empty_like(query[-1:])
    paged_attention(chunk, query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale=kv_scale, window=window,
                    num_threads=2)
    paged_attention(alone, query[-1:].clone(), k_cache, v_cache, tables, ctx, torch.tensor([0, 1], dtype=torch.int32),
                    scale, kv_scale=kv_scale, window=window, num_threads=2)
    assert torch.equal(alone[0], chunk[-1])
    expected = reference_paged_attention(query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale, window)
    torch.testing.assert_close(alone[0], expected[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("ratio, num_kv_heads, head_dim, window", [(3, 3, 64, 0), (1, 2, 48, 0), (4, 2, 40, 5),
                                                                    (32, 2, 16, 0), (2, 2, 20, 0)])
def test_a_batch_of_decodes_equals_each_decoded_alone(dtype, ratio, num_kv_heads, head_dim, window):
    # With at least 4 decoding sequences a thread, each one is a single work item over all its kv heads
    # (their rows side by side in a slot); decoded alone, a sequence is one item per kv head. Same bits,
    # with a prefill in the step too; ratio 32 makes the step's query heads outnumber a prefill tile's rows.
    contexts = (37, 100, 5, 64, 33, 17, 80, 1, 48)
    generator = torch.Generator().manual_seed(ratio * 100 + head_dim)
    seqs = [(ctx, 1) for ctx in contexts] + [(30, 4)]
    k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step(seqs, 16, num_kv_heads, head_dim, dtype, generator)
    query = torch.randn(int(qsl[-1]), num_kv_heads * ratio, head_dim, generator=generator)
    scale = 1.0 / math.sqrt(head_dim)
    batch = torch.full_like(query, float("nan"))
    paged_attention(batch, query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale=kv_scale, window=window,
                    num_threads=2)
    expected = reference_paged_attention(query, k_cache, v_cache, tables, ctx, qsl, scale, kv_scale, window)
    torch.testing.assert_close(batch, expected, rtol=1e-5, atol=1e-5)
    for s in range(len(contexts)):
        alone = torch.full_like(query[:1], float("nan"))
        paged_attention(alone, query[s:s + 1].clone(), k_cache, v_cache, tables[s:s + 1].clone(), ctx[s:s + 1].clone(),
                        torch.tensor([0, 1], dtype=torch.int32), scale, kv_scale=kv_scale, window=window,
                        num_threads=2)
        assert torch.equal(alone[0], batch[s]), f"sequence {s}"


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("ratio, num_kv_heads, head_dim, window", [(3, 3, 64, 0), (1, 2, 48, 0), (4, 2, 40, 5),
                                                                    (3, 1, 64, 40)])
def test_avx512_kernels_give_the_avx2_kernels_numbers(dtype, ratio, num_kv_heads, head_dim, window):
    # The AVX-512 kernels score two keys a register and sum each key's lanes in the AVX2 kernels' tree, and
    # add values 16 lanes a register in the same key order: a step gives the same bits on either (decodes
    # as whole-sequence items, a prefill tile, a lone query).
    from runtime._native import _attention
    if not _attention.use_avx512(True):
        pytest.skip("this CPU has no AVX-512: nothing to compare the AVX2 kernels with")
    generator = torch.Generator().manual_seed(ratio * 1000 + head_dim + window)
    for seqs in ([(ctx, 1) for ctx in (37, 100, 5, 64, 33, 17, 80, 1, 48)] + [(70, 24)], [(150, 1)]):
        k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step(seqs, 16, num_kv_heads, head_dim, dtype, generator)
        query = torch.randn(int(qsl[-1]), num_kv_heads * ratio, head_dim, generator=generator)
        outs = []
        try:
            for on in (True, False):
                _attention.use_avx512(on)
                out = torch.full_like(query, float("nan"))
                paged_attention(out, query, k_cache, v_cache, tables, ctx, qsl, 1.0 / math.sqrt(head_dim),
                                kv_scale=kv_scale, window=window, num_threads=2)
                outs.append(out)
        finally:
            _attention.use_avx512(True)
        assert torch.equal(outs[0], outs[1])


def test_thread_count_does_not_change_results():
    single, _ = run_both(MIXED_STEP, 8, 2, 64, 8, torch.float32, seed=4, num_threads=1)
    multi, _ = run_both(MIXED_STEP, 8, 2, 64, 8, torch.float32, seed=4, num_threads=2)
    assert torch.equal(single, multi)


def test_empty_step():
    out = torch.empty(0, 4, 64)
    k_cache = torch.zeros(2, 8, 2, 64)
    no_seqs = torch.zeros(0, dtype=torch.int32)
    paged_attention(out, out.clone(), k_cache, k_cache.clone(), torch.zeros(0, 3, dtype=torch.int32), no_seqs,
                    torch.zeros(1, dtype=torch.int32), 0.125)


# ---------------------------------------------------------------------------------------- kv write

@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_kv_write_stores_exact_encoding_and_skips(dtype):
    generator = torch.Generator().manual_seed(5)
    num_blocks, block_size, nkv, hd = 6, 4, 3, 48
    kv_scale = QUANT_SCALE.get(dtype, 1.0)
    key = torch.randn(9, nkv, hd, generator=generator) * 3
    value = torch.randn(9, nkv, hd, generator=generator)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, -0.0])  # saturation, underflow, signed zero
    slots = torch.tensor([5, 0, -1, 23, 7, 12, -1, 1, 8], dtype=torch.int64)
    k_cache = garbage_cache(num_blocks, block_size, nkv, hd, dtype)
    v_cache = garbage_cache(num_blocks, block_size, nkv, hd, dtype)
    untouched = k_cache.flatten(0, 1)[2].clone()
    kv_write(key, value, k_cache, v_cache, slots, kv_scale=kv_scale)
    written = slots >= 0
    for cache, source in ((k_cache, key), (v_cache, value)):
        stored = cache.flatten(0, 1)[slots[written]]
        expected = quantize_like_cache(source[written], dtype, kv_scale)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(k_cache.flatten(0, 1)[2].view(torch.uint8), untouched.view(torch.uint8))


def test_f8e4m3_rounding_matches_torch_on_every_midpoint():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.unique(codes[codes.isfinite()])  # sorted
    midpoints = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, midpoints, midpoints.nextafter(torch.tensor(0.0))]).reshape(-1, 1, 1)
    cache = torch.zeros(x.shape[0], 1, 1, 1, dtype=torch.float8_e4m3fn)
    slots = torch.arange(x.shape[0], dtype=torch.int64)
    kv_write(x, x, cache, cache.clone(), slots, kv_scale=1.0)
    expected = x.flatten().to(torch.float8_e4m3fn)
    assert torch.equal(cache.flatten().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_write_then_attend_step(dtype):
    # Write this step's keys through slot_mapping, then attend: the executor's sequence of calls.
    generator = torch.Generator().manual_seed(6)
    seqs, block_size, nh, nkv, hd = [(20, 20), (33, 7), (12, 1)], 8, 6, 2, 64
    k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step(seqs, block_size, nkv, hd, dtype, generator)
    slot_mapping = torch.cat([
        tables[s, pos // block_size].long() * block_size + pos % block_size
        for s, (c, q) in enumerate(seqs) for pos in [torch.arange(c - q, c)]])
    key = torch.randn(len(slot_mapping), nkv, hd, generator=generator)
    value = torch.randn(len(slot_mapping), nkv, hd, generator=generator)
    kv_write(key, value, k_cache, v_cache, slot_mapping, kv_scale=kv_scale)
    query = torch.randn(len(slot_mapping), nh, hd, generator=generator)
    out = paged_attention(torch.empty_like(query), query, k_cache, v_cache, tables, ctx, qsl, 0.125,
                          kv_scale=kv_scale)
    expected = reference_paged_attention(query, k_cache, v_cache, tables, ctx, qsl, 0.125, kv_scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    stored = k_cache.flatten(0, 1)[slot_mapping]
    assert torch.equal(stored.view(torch.uint8), quantize_like_cache(key, dtype, kv_scale).view(torch.uint8))


# ---------------------------------------------------------------------------------------- errors

def small_attention_args(**overrides):
    args = dict(out=torch.empty(3, 4, 16), query=torch.randn(3, 4, 16), k_cache=torch.zeros(4, 2, 2, 16),
                v_cache=torch.zeros(4, 2, 2, 16), block_tables=torch.tensor([[0, 3]], dtype=torch.int32),
                context_lens=torch.tensor([4], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 3], dtype=torch.int32), scale=0.25)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(query=torch.randn(3, 4, 16, dtype=torch.bfloat16)), "query must be float32 contiguous"),
    (dict(query=torch.randn(4, 3, 16).transpose(0, 1)), "query must be float32 contiguous.*non-contiguous"),
    (dict(out=torch.empty(3, 4, 8)), r"out must be float32 .*\(3, 4, 16\)"),
    (dict(query=torch.randn(3, 3, 16), out=torch.empty(3, 3, 16)), "num_kv_heads dividing num_heads"),
    (dict(window=-1), "window must be 0 .full attention. or positive, got -1"),
    (dict(v_cache=torch.zeros(4, 2, 2, 16, dtype=torch.float16)), "v_cache must be float32"),
    (dict(k_cache=torch.zeros(4, 2, 2, 16, dtype=torch.float64)), "k_cache dtype must be one of"),
    (dict(context_lens=torch.tensor([4], dtype=torch.int64)), "context_lens must be int32"),
    (dict(block_tables=torch.tensor([[0, 4]], dtype=torch.int32)),
     r"block_tables\[0\]\[1\] = 4 is out of range"),
    (dict(block_tables=torch.tensor([[0]], dtype=torch.int32)), "needs 2 blocks"),
    (dict(context_lens=torch.tensor([2], dtype=torch.int32)), "less than its 3 query tokens"),
    (dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int32)), "end at T = 3"),
])
def test_paged_attention_rejects_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(**small_attention_args(**overrides))


def test_quantized_scale_rejected_for_float_cache():
    with pytest.raises(ValueError, match="kv_scale applies to int8/float8_e4m3fn caches only"):
        paged_attention(**small_attention_args(), kv_scale=0.5)


def small_write_args(**overrides):
    args = dict(key=torch.randn(2, 2, 16), value=torch.randn(2, 2, 16), k_cache=torch.zeros(4, 2, 2, 16),
                v_cache=torch.zeros(4, 2, 2, 16), slot_mapping=torch.tensor([0, 7]))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(key=torch.randn(2, 2, 16).double()), "key must be float32 contiguous"),
    (dict(value=torch.randn(3, 2, 16)), r"value must be float32 .*\(2, 2, 16\)"),
    (dict(key=torch.randn(2, 1, 16), value=torch.randn(2, 1, 16)), "does not match cache"),
    (dict(slot_mapping=torch.tensor([0, 7], dtype=torch.int32)), "slot_mapping must be int64"),
    (dict(slot_mapping=torch.tensor([0, 8])), r"slot_mapping\[1\] = 8 is out of range \[-1, 8\)"),
    (dict(slot_mapping=torch.tensor([-2, 1])), r"slot_mapping\[0\] = -2 is out of range"),
])
def test_kv_write_rejects_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        kv_write(**small_write_args(**overrides))


def test_fast_path_still_checks_metadata_values():
    with pytest.raises(ValueError, match="out of range"):
        kv_write(**small_write_args(slot_mapping=torch.tensor([0, 99])), check=False)
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(**small_attention_args(block_tables=torch.tensor([[0, -1]], dtype=torch.int32)),
                        check=False)


# ---------------------------------------------------------------------------------------- fused qkv step

def fused_and_op_by_op(dtype, num_heads, num_kv_heads, head_dim, block_size, window=0, norms=False,
                       head_rms_norm=None, separate=False):
    """qkv_attention over a MIXED_STEP and the same step op by op (split, head_rms_norm of q and k when
    norms, rope, kv_write, paged_attention) on copies of the caches: (out, expected, caches, expected caches).
    head_rms_norm(x, weight, eps, head_dim): the op-by-op norm (default: the C rms_norm the executor binds).
    separate: the fused call reads q, k and v as three tensors of their own (three projections)."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, ctx, qsl, kv_scale = build_step(MIXED_STEP, block_size, num_kv_heads, head_dim,
                                                              dtype, generator)
    t = int(qsl[-1])
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 3
    positions = torch.cat([torch.arange(c - (int(qsl[s + 1]) - int(qsl[s])), c) for s, c in enumerate(ctx.tolist())])
    seq_of_token = torch.repeat_interleave(torch.arange(len(MIXED_STEP)), qsl[1:] - qsl[:-1])
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    table = reference.RopeTable(head_dim, 10000.0, None)
    table.ensure(int(ctx.max()) + 1)
    scale = 1.0 / math.sqrt(head_dim)
    q_norm, k_norm = (1.0 + 0.3 * torch.randn(head_dim, generator=generator) for _ in range(2))
    eps = 1e-6

    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    if norms:
        norm = head_rms_norm or (lambda x, w, e, hd: rowops.rms_norm(x.contiguous().view(-1, hd), w, e).view(x.shape))
        q, k = norm(q, q_norm, eps, head_dim), norm(k, k_norm, eps, head_dim)
    rope = reference.make_rope({"head_dim": head_dim, "theta": 10000.0, "num_heads": num_heads,
                                "num_kv_heads": num_kv_heads})
    q, k = rope(q, k, positions)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_write(k.reshape(t, num_kv_heads, head_dim).contiguous(), v.reshape(t, num_kv_heads, head_dim).contiguous(),
             k_ref, v_ref, slots, kv_scale=kv_scale)
    expected = paged_attention(torch.empty(t, num_heads, head_dim), q.reshape(t, num_heads, head_dim).contiguous(),
                               k_ref, v_ref, tables, ctx, qsl, scale, kv_scale=kv_scale, window=window)

    out = torch.full((t, num_heads, head_dim), float("nan"))
    parts = [p.contiguous() for p in qkv.split(q.shape[1:] + k.shape[1:] + k.shape[1:], dim=1)] if separate else []
    qkv_attention(out, parts[0] if separate else qkv, k_cache, v_cache, tables, ctx, qsl, positions, table.packed,
                  slots, num_heads, scale, kv_scale=kv_scale, window=window, q_norm=q_norm if norms else None,
                  k_norm=k_norm if norms else None, norm_eps=eps, num_threads=2,
                  **(dict(k=parts[1], v=parts[2]) if separate else {}))
    return out, expected, (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 16, 5)])
def test_qkv_attention_equals_rope_kv_write_then_paged_attention(dtype, num_heads, num_kv_heads, head_dim,
                                                                 block_size):
    """The fused step (rope + KV write + attention from the qkv projection) against the op-by-op path."""
    out, expected, caches, expected_caches = fused_and_op_by_op(dtype, num_heads, num_kv_heads, head_dim, block_size)
    for cache, expected_cache in zip(caches, expected_caches):  # bytes: unwritten slots hold NaN
        assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, 0), (4, 4, 32, 8, 7), (8, 2, 16, 5, 0), (6, 2, 20, 8, 45), (4, 1, 256, 16, 40)])
def test_qkv_attention_with_q_k_norms_equals_head_rms_norm_then_rope_then_attention(
        dtype, num_heads, num_kv_heads, head_dim, block_size, window):
    """Gemma 3's chain: the fused step normalizes each q and k head with the rms_norm row kernel, so the
    cache holds the op-by-op bytes and the attention reads the same queries."""
    out, expected, caches, expected_caches = fused_and_op_by_op(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                                window, norms=True)
    for cache, expected_cache in zip(caches, expected_caches):
        assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("norms", [False, True])
def test_qkv_attention_reads_q_k_and_v_from_three_projections(dtype, norms):
    """q, k and v as tensors of their own (projections in different weight formats): the same bytes in the
    cache and the same output as op by op."""
    out, expected, caches, expected_caches = fused_and_op_by_op(dtype, 4, 1, 32, 8, 7, norms=norms, separate=True)
    for cache, expected_cache in zip(caches, expected_caches):
        assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_qkv_attention_q_k_norms_match_torch_s_head_rms_norm():
    # torch's mean of squares sums in another order than the row kernel: equal within float32 rounding
    out, expected, (k_cache, _), (k_ref, _) = fused_and_op_by_op(torch.float32, 6, 2, 48, 8, norms=True,
                                                                 head_rms_norm=reference.head_rms_norm)
    written = ~k_ref.isnan()
    torch.testing.assert_close(k_cache[written], k_ref[written], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def small_qkv_args(**overrides):
    t, nh, nkv, hd = 2, 2, 1, 8
    args = dict(out=torch.empty(t, nh, hd), qkv=torch.randn(t, (nh + 2 * nkv) * hd),
                k_cache=torch.zeros(2, 4, nkv, hd), v_cache=torch.zeros(2, 4, nkv, hd),
                block_tables=torch.tensor([[0, 1]], dtype=torch.int32), context_lens=torch.tensor([2], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 2], dtype=torch.int32), positions=torch.tensor([0, 1]),
                rope=torch.zeros(4, hd), slot_mapping=torch.tensor([0, 1]), num_heads=nh, scale=0.5)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,message", [
    (dict(positions=torch.tensor([0, 4])), "outside the rope table"),
    (dict(positions=torch.tensor([0, -1])), "outside the rope table"),
    (dict(slot_mapping=torch.tensor([0, 8])), "slot_mapping\\[1\\] = 8 is out of range"),
    (dict(qkv=torch.randn(2, 24)), "qkv must be \\[T, 32\\]"),
    (dict(rope=torch.zeros(4, 6)), "rope must be \\[rows, 8\\]"),
    (dict(num_heads=0), "positive multiple of the cache.s num_kv_heads"),
    (dict(positions=torch.tensor([0, 1], dtype=torch.int32)), "positions must be int64"),
    (dict(q_norm=torch.ones(6)), r"q_norm must be float32 contiguous CPU \[head_dim\] \(8,\)"),
    (dict(k_norm=torch.ones(8, dtype=torch.float64)), "k_norm must be float32"),
    (dict(qkv=torch.randn(2, 16), k=torch.randn(2, 8)), "k and v come together"),
    (dict(qkv=torch.randn(2, 16), k=torch.randn(2, 8), v=torch.randn(2, 6)), r"v must be float32.*\(2, 8\)"),
    (dict(qkv=torch.randn(2, 32), k=torch.randn(2, 8), v=torch.randn(2, 8)), r"q must be \[T, 16\]"),
])
def test_qkv_attention_rejects_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        qkv_attention(**small_qkv_args(**overrides))


def test_qkv_attention_c_side_checks_indices_without_the_python_checks():
    with pytest.raises(ValueError, match="outside the rope table"):
        qkv_attention(**small_qkv_args(positions=torch.tensor([0, 9])), check=False)
    with pytest.raises(ValueError, match="out of range"):
        qkv_attention(**small_qkv_args(slot_mapping=torch.tensor([0, -2])), check=False)
    with pytest.raises(ValueError, match="k_norm has 28 bytes, expected 32"):
        qkv_attention(**small_qkv_args(q_norm=torch.ones(8), k_norm=torch.ones(7)), check=False)
