"""Sampling on the device: penalties, greedy and the exponential race over logits [R, V], one program per row.

The same rules as runtime/core/sampler.py (the CPU sampler, which says why they are what they are), with one
program per row looping over the vocabulary in tiles of TILE, so any V works with one compiled variant:
- apply_penalties / hold_back: the repetition, frequency and presence penalties and min_tokens' held-back ids,
  in place, over the few ids the host lists per row (two kernels: held-back ids are not penalised ids);
- mask_bits: a grammar's mask (runtime/core/constraints.py) applied in place: -inf wherever the row's bit is clear,
  32 tokens a word, as _ops.mask_rows_bits does on the host;
- greedy: argmax, ties to the lowest token id;
- top_logprobs: log_softmax's value of each row's chosen token and its k largest values, ties to the lower id,
  found in k passes over the row (k <= 20), so only R x (k + 1) numbers reach the host;
- sample: p = exp(logits / temperature - max), softmax's numerators (the kept set and the race's winner do
  not depend on the common 1 / sum); top-k and top-p keep the tokens with p >= a threshold found by
  bisection on the bits of a float32 (positive floats order as their bits), one pass over the row per step,
  30 steps at most each; then the token is argmax(kept p / noise), noise ~ Exp(1), ties to the lowest id.
Ties at a cut are kept whole: top-k keeps every token as likely as the k-th (so more than k at a tie), top-p
every token as likely as the last one it needs; the CPU sampler orders a tie by token id and cuts inside it.
Noise is the host's [R, V] rows (HOST_NOISE: the CPU sampler's race_noise, so the same tokens), or drawn here
with Philox as -log(rand(seed, position * V + token)): a function of the sequence's seed and output position
only, never of its row in the batch. Logits may be float32, float16 or bfloat16; the math is float32, and
the penalised logits are stored back in the logits' dtype.
The kernels call builtins only (tl.full, tl.reduce with the standard combine functions, Philox written out),
which compile as tl.zeros, tl.max, tl.sum and tl.rand do; they were written before the interpreter launcher
could run Triton's library functions (runtime/backends/cuda/launch.py).
"""

from __future__ import annotations

import torch
import triton.language as tl

from runtime.backends.cuda.launch import Launcher, kernel

ONE_BITS = tl.constexpr(0x3F800000)   # float32 1.0 as int32: the largest p, the top of every bisection
MIN_UNIFORM = tl.constexpr(2.0**-32)  # under tl.rand's smallest step (2**-31): rand() = 0 gives noise 22.2, not inf
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)    # Philox-4x32's constants, as triton.language.random's
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)


@kernel(num_warps=4)
def _penalties_kernel(logits_ptr, ids_ptr, counts_ptr, repetition_ptr, frequency_ptr, presence_ptr,
                      V, L, stride, LIST_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    for start in range(0, L, LIST_TILE):
        offs = start + tl.arange(0, LIST_TILE)
        ids = tl.load(ids_ptr + row * L + offs, mask=offs < L, other=-1)
        listed = (ids >= 0) & (ids < V)
        count = tl.load(counts_ptr + row * L + offs, mask=listed, other=0).to(tl.float32)
        x = tl.load(logits_ptr + row * stride + ids, mask=listed, other=0.0).to(tl.float32)
        # Every listed id is in the prompt or the output; repetition 1 leaves x as it is (x / 1 and x * 1 are x).
        x = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
        x = x - (frequency * count + presence * (count > 0).to(tl.float32))
        tl.store(logits_ptr + row * stride + ids, x.to(logits_ptr.dtype.element_ty), mask=listed)


@kernel(num_warps=4)
def _hold_back_kernel(logits_ptr, ids_ptr, V, L, stride, LIST_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, L, LIST_TILE):
        offs = start + tl.arange(0, LIST_TILE)
        ids = tl.load(ids_ptr + row * L + offs, mask=offs < L, other=-1)
        minus_inf = tl.full([LIST_TILE], float("-inf"), tl.float32)
        tl.store(logits_ptr + row * stride + ids, minus_inf.to(logits_ptr.dtype.element_ty),
                 mask=(ids >= 0) & (ids < V))


@kernel(num_warps=4)
def _greedy_kernel(logits_ptr, out_ptr, V, stride, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, TILE)
    best = tl.full([TILE], float("-inf"), tl.float32)  # each lane's max so far ...
    best_id = lanes                                     # ... at its first (lowest) id: updates need strictly more
    for start in range(0, V, TILE):
        offs = start + lanes
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_id = tl.where(better, offs, best_id)
    top = tl.reduce(best, 0, tl.standard._elementwise_max)
    tl.store(out_ptr + row, tl.reduce(tl.where(best == top, best_id, V), 0, tl.standard._elementwise_min))


@kernel(num_warps=4)
def _mask_bits_kernel(logits_ptr, rows_ptr, bits_ptr, V, words, stride, TILE: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + m)
    lanes = tl.arange(0, TILE)
    minus_inf = tl.full([TILE], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    for start in range(0, V, TILE):
        offs = start + lanes
        word = offs // 32
        bits = tl.load(bits_ptr + m * words + word, mask=(offs < V) & (word < words), other=0)
        allowed = ((bits >> (offs % 32)) & 1) != 0  # an arithmetic shift keeps bit 0 right for bit 31 too
        tl.store(logits_ptr + row * stride + offs, minus_inf, mask=(offs < V) & ~allowed)


@kernel(num_warps=4)
def _top_logprobs_kernel(logits_ptr, tokens_ptr, chosen_ptr, values_ptr, ids_ptr, V, K, stride, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, TILE)
    base = logits_ptr + row * stride
    # log-sum-exp in one pass: each lane's running max and its sum of exp(x - max)
    most = tl.full([TILE], float("-inf"), tl.float32)
    total = tl.zeros([TILE], tl.float32)
    for start in range(0, V, TILE):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        grown = tl.maximum(most, x)
        shift = tl.where(grown > float("-inf"), grown, 0.0)  # no -inf - -inf: exp(-inf - 0) is 0
        total = total * tl.exp(most - shift) + tl.exp(x - shift)
        most = grown
    top = tl.reduce(most, 0, tl.standard._elementwise_max)
    top = tl.where(top > float("-inf"), top, 0.0)
    lse = top + tl.log(tl.sum(total * tl.exp(most - top), axis=0))
    token = tl.load(tokens_ptr + row).to(tl.int64)
    tl.store(chosen_ptr + row, tl.load(base + token).to(tl.float32) - lse)
    # the k largest, one pass each: the largest (value, -id) below the last one found
    last, last_id = float("inf"), -1
    for j in range(K):
        best = tl.full([TILE], float("-inf"), tl.float32)
        best_id = tl.full([TILE], V, tl.int32)
        for start in range(0, V, TILE):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            below = (offs < V) & ((x < last) | ((x == last) & (offs > last_id)))
            better = below & ((x > best) | ((x == best) & (offs < best_id)))
            best = tl.where(better, x, best)
            best_id = tl.where(better, offs, best_id)
        found = tl.reduce(best, 0, tl.standard._elementwise_max)
        found_id = tl.reduce(tl.where(best == found, best_id, V), 0, tl.standard._elementwise_min)
        tl.store(values_ptr + row * K + j, found - lse)
        tl.store(ids_ptr + row * K + j, found_id)
        last, last_id = found, found_id


@kernel(num_warps=4)
def _sample_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, position_ptr, noise_ptr, out_ptr,
                   V, stride, TILE: tl.constexpr, HOST_NOISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, TILE)
    base = logits_ptr + row * stride
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)

    row_max = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, V, TILE):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        row_max = tl.maximum(row_max, x / temperature)
    top = tl.reduce(row_max, 0, tl.standard._elementwise_max)

    # top-k: the k-th largest p is the largest t with count(p >= t) >= k (lo holds, hi fails). Off: no step.
    lo = tl.full([], 0, tl.int32)
    hi = tl.where((top_k > 0) & (top_k < V), ONE_BITS + 1, 1)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        t = mid.to(tl.float32, bitcast=True)
        count = tl.full([TILE], 0, tl.int32)
        for start in range(0, V, TILE):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            count += ((offs < V) & (tl.exp(x / temperature - top) >= t)).to(tl.int32)
        n = tl.reduce(count, 0, tl.standard._sum_combine)
        lo = tl.where(n >= top_k, mid, lo)
        hi = tl.where(n >= top_k, tl.where(n == top_k, mid + 1, hi), mid)  # exactly k above mid: done
    threshold = lo.to(tl.float32, bitcast=True)  # 0.0 when top-k is off

    # top-p: a token stays while the kept mass strictly above its p is < top_p * kept total. That mass only
    # falls as p grows, so the kept set is p >= the smallest t with mass(> t) < top_p * total (hi holds).
    if top_p < 1.0:
        total = tl.full([TILE], 0.0, tl.float32)
        for start in range(0, V, TILE):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            p = tl.exp(x / temperature - top)
            total += tl.where(p >= threshold, p, 0.0)
        target = top_p * tl.reduce(total, 0, tl.standard._sum_combine)
        lo = lo - 1  # just below the top-k cut, where the mass above is all of it: fails
        hi = tl.full([], ONE_BITS, tl.int32)  # nothing is above p = 1: holds
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = mid.to(tl.float32, bitcast=True)
            above = tl.full([TILE], 0.0, tl.float32)
            for start in range(0, V, TILE):
                offs = start + lanes
                x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                p = tl.exp(x / temperature - top)
                above += tl.where((p >= threshold) & (p > t), p, 0.0)
            holds = tl.reduce(above, 0, tl.standard._sum_combine) < target
            hi = tl.where(holds, mid, hi)
            lo = tl.where(holds, lo, mid)
        threshold = hi.to(tl.float32, bitcast=True)

    # The exponential race: argmax(kept p / noise), ties to the lowest id; dropped tokens race with 0 as on
    # the CPU, lanes past V with -1 so they never win.
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row).to(tl.int64)
    best = tl.full([TILE], -1.0, tl.float32)
    best_id = lanes
    for start in range(0, V, TILE):
        offs = start + lanes
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(x / temperature - top)
        if HOST_NOISE:
            noise = tl.load(noise_ptr + row * V + offs, mask=valid, other=1.0)
        else:
            # tl.rand(seed, offset) written out: Philox-4x32-10 on (offset lo, offset hi, 0, 0), key (seed lo, hi)
            offset = position * V + offs
            c0 = offset.to(tl.uint32)
            c1 = (offset >> 32).to(tl.uint32)
            c2 = c0 * 0
            c3 = c2
            k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
            k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
            for _ in tl.static_range(10):
                c0, c1, c2, c3 = (tl.umulhi(PHILOX_ROUND_B, c2) ^ c1 ^ k0, c2 * PHILOX_ROUND_B,
                                  tl.umulhi(PHILOX_ROUND_A, c0) ^ c3 ^ k1, c0 * PHILOX_ROUND_A)
                k0 = k0 + PHILOX_KEY_A
                k1 = k1 + PHILOX_KEY_B
            bits = c0.to(tl.int32, bitcast=True)
            uniform = tl.where(bits < 0, ~bits, bits) * 4.6566127342e-10  # [0, 1), as tl.rand
            noise = -tl.log(tl.maximum(uniform, MIN_UNIFORM))
        ratio = tl.where(valid, tl.where(p >= threshold, p / noise, 0.0), -1.0)
        better = ratio > best
        best = tl.where(better, ratio, best)
        best_id = tl.where(better, offs, best_id)
    winner = tl.reduce(best, 0, tl.standard._elementwise_max)
    tl.store(out_ptr + row, tl.reduce(tl.where(best == winner, best_id, V), 0, tl.standard._elementwise_min))


def _check_logits(name: str, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.float16,
                                                                          torch.bfloat16):
        raise ValueError(f"{name}: logits must be [R, V] float32/float16/bfloat16 with unit stride along V, "
                         f"got {tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")


def _check_rows(name: str, logits: torch.Tensor, **arrays: tuple[torch.Tensor, torch.dtype]) -> None:
    for arg, (a, dtype) in arrays.items():
        if a.dtype != dtype or a.shape[0] != logits.shape[0] or not a.is_contiguous():
            raise ValueError(f"{name}: {arg} must be a contiguous {dtype} tensor with {logits.shape[0]} rows, "
                             f"got {tuple(a.shape)} {a.dtype}")


def apply_penalties(launcher: Launcher, logits: torch.Tensor, token_ids: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                    list_tile: int = 128) -> None:
    """Penalise logits [R, V] in place. token_ids int32 [R, L]: each row's distinct prompt and output ids, -1
    padding; output_counts int32 [R, L]: how often each occurs in the output (0: prompt only); repetition,
    frequency, presence float32 [R] (1, 0, 0: off)."""
    _check_logits("apply_penalties", logits)
    _check_rows("apply_penalties", logits, token_ids=(token_ids, torch.int32),
                output_counts=(output_counts, torch.int32), repetition=(repetition, torch.float32),
                frequency=(frequency, torch.float32), presence=(presence, torch.float32))
    if output_counts.shape != token_ids.shape:
        raise ValueError(f"apply_penalties: output_counts {tuple(output_counts.shape)} must match token_ids "
                         f"{tuple(token_ids.shape)}")
    R, V = logits.shape
    launcher.launch(_penalties_kernel, (R,), [logits, token_ids, output_counts, repetition, frequency, presence,
                                              V, token_ids.shape[1], logits.stride(0)], LIST_TILE=list_tile)


def hold_back(launcher: Launcher, logits: torch.Tensor, token_ids: torch.Tensor, list_tile: int = 128) -> None:
    """Set logits [R, V] to -inf at token_ids int32 [R, L] (-1 padding): min_tokens' held-back ids."""
    _check_logits("hold_back", logits)
    _check_rows("hold_back", logits, token_ids=(token_ids, torch.int32))
    R, V = logits.shape
    launcher.launch(_hold_back_kernel, (R,), [logits, token_ids, V, token_ids.shape[1], logits.stride(0)],
                    LIST_TILE=list_tile)


def greedy(launcher: Launcher, logits: torch.Tensor, tile: int = 1024) -> torch.Tensor:
    """logits [R, V] -> int32 [R]: each row's argmax, ties to the lowest id."""
    _check_logits("greedy", logits)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int32, device=logits.device)
    launcher.launch(_greedy_kernel, (R,), [logits, out, V, logits.stride(0)], TILE=tile)
    return out


def mask_bits(launcher: Launcher, logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor,
              tile: int = 1024) -> None:
    """Set to -inf, in place, logits[rows[m], v] wherever bit v % 32 of bits[m, v // 32] is clear (and every v past
    the words): a grammar's mask. logits [R, V]; rows int64 [M]; bits int32 [M, words], llguidance's bitmask."""
    _check_logits("mask_bits", logits)
    if rows.dtype != torch.int64 or rows.dim() != 1 or bits.dtype != torch.int32 or bits.dim() != 2 \
            or bits.shape[0] != rows.shape[0] or not bits.is_contiguous():
        raise ValueError(f"mask_bits: rows must be int64 [M] and bits contiguous int32 [M, words], got "
                         f"{tuple(rows.shape)} {rows.dtype} and {tuple(bits.shape)} {bits.dtype}")
    V = logits.shape[1]
    launcher.launch(_mask_bits_kernel, (rows.shape[0],), [logits, rows, bits, V, bits.shape[1], logits.stride(0)],
                    TILE=tile)


TOP_LOGPROBS_MAX = 20  # OpenAI's limit; the kernel takes one pass over the row per alternative


def top_logprobs(launcher: Launcher, logits: torch.Tensor, tokens: torch.Tensor, k: int,
                 tile: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] and tokens int32 [R] -> (float32 [R]: log_softmax of each row at its token; float32 [R, k] and
    int32 [R, k]: the row's k largest log_softmax values and their ids, largest first, ties to the lower id).
    Values within float32 rounding of torch's log_softmax (the sum is taken in another order)."""
    _check_logits("top_logprobs", logits)
    _check_rows("top_logprobs", logits, tokens=(tokens, torch.int32))
    if not 0 <= k <= TOP_LOGPROBS_MAX:
        raise ValueError(f"top_logprobs: k must be between 0 and {TOP_LOGPROBS_MAX}, got {k}")
    R, V = logits.shape
    chosen = torch.empty(R, dtype=torch.float32, device=logits.device)
    values = torch.empty(R, max(k, 1), dtype=torch.float32, device=logits.device)  # k = 0: never written
    ids = torch.empty(R, max(k, 1), dtype=torch.int32, device=logits.device)
    launcher.launch(_top_logprobs_kernel, (R,), [logits, tokens, chosen, values, ids, V, k, logits.stride(0)],
                    TILE=tile)
    return chosen, values[:, :k], ids[:, :k]


def sample(launcher: Launcher, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, noise: torch.Tensor | None = None,
           tile: int = 1024) -> torch.Tensor:
    """logits [R, V] -> int32 [R] sampled ids. temperature float32 [R] (> 0); top_k int32 [R] (0 or >= V: off);
    top_p float32 [R] (1: off); seeds int64 [R] and positions int32 [R] (output index) pick the Philox noise,
    unless noise float32 [R, V] (Exp(1) draws) is given."""
    _check_logits("sample", logits)
    _check_rows("sample", logits, temperature=(temperature, torch.float32), top_k=(top_k, torch.int32),
                top_p=(top_p, torch.float32), seeds=(seeds, torch.int64), positions=(positions, torch.int32))
    R, V = logits.shape
    if noise is not None and (noise.shape != logits.shape or noise.dtype != torch.float32
                              or not noise.is_contiguous()):
        raise ValueError(f"sample: noise must be contiguous float32 {tuple(logits.shape)}, "
                         f"got {tuple(noise.shape)} {noise.dtype}")
    host_noise = noise is not None
    if noise is None:  # the kernel still takes a pointer; a 1-element stand-in keeps one signature
        noise = torch.empty(1, dtype=torch.float32, device=logits.device)
    out = torch.empty(R, dtype=torch.int32, device=logits.device)
    launcher.launch(_sample_kernel, (R,), [logits, temperature, top_k, top_p, seeds, positions, noise, out,
                                           V, logits.stride(0)], TILE=tile, HOST_NOISE=host_noise)
    return out
