"""Section 1 of benchmarks/gpu_check.py: the cuda backend's kernels on the device against the CPU references.

Each case builds small inputs on the CPU (the unit tests' shapes, tests/unit/test_cuda_kernels_*.py), computes
the expected output with the C kernels / torch references the unit tests use, records the kernel variants the
call asks for (RecordingLauncher), compiles them for the device's compute capability (the build's own
compile_variant), runs the call again through a CubinLauncher on CUDA tensors, and compares under the unit
tests' tolerances. With interpret=True the compiled variants run in Triton's interpreter on the CPU instead
(InterpreterLauncher restricted to them), which exercises everything but the cubin launch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

NAN = float("nan")


@dataclass
class Case:
    name: str
    inputs: tuple              # CPU tensors and plain values, moved to the device (tensors copied) for each run
    run: Callable              # run(launcher, *inputs) -> output tensor (on the inputs' device)
    expected: torch.Tensor     # CPU reference
    check: tuple               # ("close", rtol, atol) | ("abs", atol) | ("bits",) | ("equal",)


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _row_cases() -> list[Case]:
    from runtime.backends.cuda.kernels import rows
    from runtime.ops import reference, rowops

    f32, bf16 = ("close", 1e-6, 1e-6), ("close", torch.finfo(torch.bfloat16).eps, 1e-5)
    x, res, w = _randn(5, 96, seed=1, scale=3), _randn(5, 96, seed=2), _randn(96, seed=3)
    table = reference.RopeTable(64, 10000.0, None)
    table.ensure(64)
    pos = torch.tensor([0, 5, 15, 16, 40])
    qk = _randn(5, 6 * 64, seed=4, scale=2)
    cos, sin = table.lookup(pos)
    rope_ref = torch.cat([reference._rotate(qk[:, :256], cos, sin, 4), reference._rotate(qk[:, 256:], cos, sin, 2)], 1)
    gate_up = _randn(5, 128, seed=5, scale=6)
    xb = x.to(torch.bfloat16)
    return [
        Case("rows.rms_norm f32", (x, w), lambda L, x, w: rows.rms_norm(L, x, w, 1e-6), rowops.rms_norm(x, w, 1e-6),
             f32),
        Case("rows.rms_norm bf16", (xb, w), lambda L, x, w: rows.rms_norm(L, x, w, 1e-5).float(),
             reference.rms_norm(xb.float(), w, 1e-5), bf16),
        Case("rows.add_rms_norm f32", (x, res, w), lambda L, x, r, w: torch.cat(rows.add_rms_norm(L, x, r, w, 1e-6)),
             torch.cat(rowops.add_rms_norm(x, res, w, 1e-6)), f32),
        Case("rows.head_rms_norm f32", (x, _randn(24, seed=6)),
             lambda L, x, w: rows.head_rms_norm(L, x, w, 1e-6),
             reference.head_rms_norm(x, _randn(24, seed=6), 1e-6, 24), f32),
        Case("rows.rope f32", (qk[:, :256].contiguous(), qk[:, 256:].contiguous(), pos, table.packed),
             lambda L, q, k, p, t: torch.cat(rows.rope(L, q, k, p, t, 4, 2, 64), 1), rope_ref, f32),
        Case("rows.gated_act silu f32", (gate_up,), lambda L, g: rows.gated_act(L, "silu", g),
             rowops.silu_mul(gate_up, "silu"), f32),
        Case("rows.gated_act gelu_tanh f32", (gate_up,), lambda L, g: rows.gated_act(L, "gelu_tanh", g),
             rowops.silu_mul(gate_up, "gelu_tanh"), f32),
    ]


def _kv_write_case(cache_dtype: torch.dtype, kv_scale: float) -> Case:
    from runtime.backends.cuda.kernels import attention as gpu
    from runtime.ops import attention as native

    nkv, hd, shape = 2, 24, (5, 4, 2, 24)
    qkv = _randn(7, 8 * hd, seed=0, scale=8)
    if cache_dtype == torch.float8_e4m3fn:  # values that need no rounding, and some that must saturate
        qkv = (qkv / kv_scale).to(cache_dtype).float() * kv_scale
        qkv[:, ::7] = 60.0 * torch.sign(qkv[:, ::7])
    k, v = qkv[:, 4 * hd:6 * hd].contiguous(), qkv[:, 6 * hd:].contiguous()
    slots = torch.tensor([3, -1, 17, 0, 9, -1, 19], dtype=torch.int32)
    empty = lambda: torch.full(shape, NAN).to(cache_dtype)  # noqa: E731
    k_ref, v_ref = empty(), empty()
    native.kv_write(k.reshape(7, nkv, hd), v.reshape(7, nkv, hd), k_ref, v_ref, slots.long(), kv_scale=kv_scale)

    def run(L, k, v, kc, vc, s):
        gpu.kv_write(L, k, v, kc, vc, s, kv_scale)
        return torch.cat([kc, vc])

    check = ("close", 2 ** -7, 0.0) if cache_dtype == torch.bfloat16 else ("bits",)
    return Case(f"attention.kv_write {str(cache_dtype)[6:]}", (k, v, empty(), empty(), slots), run,
                torch.cat([k_ref, v_ref]), check)


def _rope_kv_case() -> Case:
    """rope_kv_write (f32, GQA 4/2, head_dim 64, one token skipped) against its torch reference: q and the caches."""
    from runtime.backends.cuda.kernels import attention as gpu
    from runtime.backends.cuda.kernels.references import rope_kv_write as reference
    from runtime.ops.reference import RopeTable

    rope = RopeTable(64, 10000.0, None)
    rope.ensure(32)
    table, positions = rope.packed[:32].contiguous(), torch.tensor([3, 30, 0, 11])
    qkv, slots = _randn(4, 8 * 64, seed=3), torch.tensor([6, -1, 0, 15])

    def run(L, qkv, kc, vc, p, t, s):
        q, k, v = qkv.split([256, 128, 128], dim=-1)
        if L is None:  # the reference, on the host
            reference((4, 6), q, k, v, kc, vc, p, t, s, 512, 512, 512, 2, 1.0, NUM_HEADS=4, HEAD_DIM=64, HALF_BLOCK=32,
                      QUANTIZED=False)
        else:
            gpu.rope_kv_write(L, q, k, v, kc, vc, p, t, s, 4)
        return torch.cat([q.flatten(), kc.flatten(), vc.flatten()]).float()

    caches = lambda: torch.zeros(4, 4, 2, 64)  # noqa: E731
    expected = run(None, qkv.clone(), caches(), caches(), positions, table, slots)
    return Case("attention.rope_kv_write f32", (qkv, caches(), caches(), positions, table, slots), run, expected,
                ("abs", 1e-5))


def _paged_case(act: torch.dtype, cache_dtype: torch.dtype, kv_scale: float, seed: int, splits: int = 0) -> Case:
    """A prefill chunk of 11 after a cached prefix of 9, two decodes, a one-token prompt; GQA 4/2, head_dim 32.
    splits: decodes alone (300, 13, 70 and 1 keys) through decode_attention, up to that many splits of 32 keys."""
    from runtime.backends.cuda.kernels import attention as gpu
    from runtime.ops import attention as native

    steps = [(300, 1), (13, 1), (70, 1), (1, 1)] if splits else [(20, 11), (13, 1), (6, 1), (1, 1)]
    nh, nkv, hd, bs = 4, 2, 32, 4
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // bs) for c, _ in steps]
    order = torch.randperm(sum(per_seq) + 2, generator=g).tolist()
    shape = (sum(per_seq) + 2, bs, nkv, hd)
    k_cache, v_cache = torch.full(shape, NAN).to(cache_dtype), torch.full(shape, NAN).to(cache_dtype)
    tables = torch.zeros(len(steps), max(per_seq), dtype=torch.int32)
    ks, vs, slots = [], [], []
    for s, (ctx, _) in enumerate(steps):
        for b in range(per_seq[s]):
            tables[s, b] = order.pop()
        p = torch.arange(ctx)
        slots.append(tables[s, p // bs].long() * bs + p % bs)
        ks.append(torch.randn(ctx, nkv, hd, generator=g))
        vs.append(torch.randn(ctx, nkv, hd, generator=g))
    native.kv_write(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.cat(slots), kv_scale=kv_scale)
    qlens = [q for _, q in steps]
    q = torch.randn(sum(qlens), nh * hd, generator=g).to(act)
    ctx_lens = torch.tensor([c for c, _ in steps], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    expected = torch.empty(q.shape[0], nh, hd)
    native.paged_attention(expected, q.float().reshape(-1, nh, hd), k_cache, v_cache, tables, ctx_lens, qsl,
                           hd ** -0.5, kv_scale=kv_scale, window=0)

    def run(L, q, kc, vc, bt, cl, qs):
        out = torch.empty_like(q)
        if splits:
            gpu.decode_attention(L, out, q, kc, vc, bt, cl, qs, hd ** -0.5, num_heads=nh, kv_scale=kv_scale,
                                 splits=splits, min_keys=32)
        else:
            gpu.paged_attention(L, out, q, kc, vc, bt, cl, qs, hd ** -0.5, num_heads=nh, kv_scale=kv_scale, window=0,
                                max_query_len=max(qlens))
        return out.float()

    largest = v_cache.float().nan_to_num().abs().max().item() * kv_scale  # what v reads as (fp8: times its scale)
    tol = 1e-5 if act == torch.float32 else 2 * torch.finfo(act).eps * largest
    return Case(f"attention.{'decode split' if splits else 'paged'} {str(act)[6:]} act, {str(cache_dtype)[6:]} cache",
                (q, k_cache, v_cache, tables, ctx_lens, qsl), run, expected.reshape(q.shape[0], -1), ("abs", tol))


def _gemm_cases() -> list[Case]:
    from runtime.backends.cuda.kernels import gemm
    from runtime.weights import fp8, int4

    n = 48
    eps32 = torch.finfo(torch.float32).eps

    def weights(k, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, k, generator=g) * torch.linspace(0.5, 2.0, k) * torch.rand(n, 1, generator=g).add(0.5)

    def case(name, x, w_deq, run, inputs, bias=None):
        """The unit tests' bound: 16 eps32 (f32) or the activation dtype's eps, times max |x| @ |w|.T."""
        ref = x.double() @ w_deq.double().T + (0 if bias is None else bias.double())
        scale = (x.double().abs() @ w_deq.double().abs().T).max().item()
        tol = (16 * eps32 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps) * scale
        return Case(name, inputs, lambda L, *a: run(L, *a).double(), ref, ("abs", tol))

    out = []
    q, s, z, _ = int4.quantize(weights(256, 0), 64)
    packed, deq = gemm.pack_int4(q), int4.dequantize(q, s, z)
    bias = _randn(n, seed=4)
    for t, dtype in ((1, torch.float32), (20, torch.float32), (3, torch.bfloat16), (20, torch.bfloat16)):
        x = _randn(t, 256, seed=t).to(dtype)
        out.append(case(f"gemm.int4 g64 {str(dtype)[6:]} T={t}", x, deq,
                        lambda L, x, p, s, z, b: gemm.linear_int4(L, x, p, s, z, 64, b), (x, packed, s, z, bias), bias))
    for per_channel, t, dtype in ((True, 1, torch.float32), (False, 20, torch.float32), (True, 20, torch.bfloat16)):
        q8, s8, _, _ = fp8.quantize(weights(128, 5), per_channel)
        x = _randn(t, 128, seed=6).to(dtype)
        out.append(case(f"gemm.fp8 {'channel' if per_channel else 'tensor'} {str(dtype)[6:]} T={t}", x,
                        fp8.dequantize(q8, s8), lambda L, x, q, s, b: gemm.linear_fp8(L, x, q, s, b), (x, q8, s8, bias),
                        bias))
    # fp8 activations: x quantized per token as torch rounds it; f32 accumulation, then a bf16 output
    q8, s8, _, _ = fp8.quantize(weights(256, 9), True)
    x = _randn(20, 256, seed=10).to(torch.bfloat16)
    xs = x.float().abs().amax(1) / fp8.MAX
    x_deq = (x.float() / xs[:, None]).to(torch.float8_e4m3fn).double() * xs.double()[:, None]
    w_deq = fp8.dequantize(q8, s8).double()
    scale = (x_deq.abs() @ w_deq.abs().T).max().item()
    out.append(Case("gemm.fp8 act bf16 T=20", (x, q8, s8),
                    lambda L, x, q, s: gemm.linear_fp8(L, x, q, s, fp8_act=True).double(), x_deq @ w_deq.T,
                    ("abs", 16 * eps32 * scale + torch.finfo(torch.bfloat16).eps * scale)))
    return out


def _sampling_cases() -> list[Case]:
    from runtime._native import _ops
    from runtime.backends.cuda.kernels import sampling
    from runtime.core.sampler import Sampler, _adjust, race_noise
    from runtime.core.sampling import SamplingParams
    from runtime.core.sequence import Sequence

    def seq(params, prompt, output):
        s = Sequence("s", list(prompt), params)
        s.output_token_ids = list(output)
        s.token_ids = s.prompt_token_ids + s.output_token_ids
        return s

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 700, generator=gen)
    logits[1, [5, 400, 650]] = 9.0
    logits[3, [699, 3]] = 9.0
    logits[4] = float("-inf")
    cases = [Case("sampling.greedy f32", (logits,), lambda L, x: sampling.greedy(L, x, tile=128).long(),
                  logits.argmax(-1), ("equal",))]
    # penalties and held-back ids: the CPU sampler's _adjust, exactly (f32 logits)
    settings = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.5, -0.25), (1.0, -1.5, 2.0), (2.0, 2.0, 1.0)]
    seqs = []
    for i, (rep, freq, pres) in enumerate(settings):
        prompt = torch.randint(0, 300, (5 + 7 * i,), generator=gen).tolist()
        output = torch.randint(0, 300, (3 * i,), generator=gen).tolist() + prompt[:i]
        seqs.append(seq(SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                                       min_tokens=4 * (i % 2), max_tokens=20, eos_token_ids=(7,),
                                       stop_token_ids=(11, 299)), prompt, output))
    pl = torch.randn(len(seqs), 300, generator=gen) * 4
    expected = pl.clone()
    for row, s in zip(expected, seqs):
        _adjust(row, s)
    lists = [sorted(set(s.prompt_token_ids) | set(s.output_token_ids)) for s in seqs]
    ids = torch.full((len(seqs), max(map(len, lists))), -1, dtype=torch.int32)
    counts = torch.zeros_like(ids)
    held = torch.full((len(seqs), 3), -1, dtype=torch.int32)
    for i, (s, row) in enumerate(zip(seqs, lists)):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        counts[i, :len(row)] = torch.tensor([s.output_token_ids.count(t) for t in row], dtype=torch.int32)
        h = s.params.held_back_token_ids(s.num_output_tokens)
        held[i, :len(h)] = torch.tensor(h, dtype=torch.int32)
    f32 = lambda j: torch.tensor([x[j] for x in settings], dtype=torch.float32)  # noqa: E731

    def penalize(L, x, ids, counts, rep, freq, pres, held):
        sampling.apply_penalties(L, x, ids, counts, rep, freq, pres, list_tile=16)
        sampling.hold_back(L, x, held, list_tile=16)
        return x

    cases.append(Case("sampling.penalties+hold_back f32", (pl, ids, counts, f32(0), f32(1), f32(2), held), penalize,
                      expected, ("equal",)))
    # sampling with the host's noise: the CPU sampler's draws, token for token
    combos = [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.5, 40, 1.0), (1.0, -1, 0.9), (1.3, 20, 0.8), (1.0, 3, 0.3)]
    sseqs = [seq(SamplingParams(temperature=t, top_k=k, top_p=p, seed=100 * i + j), [1], [2] * (i + j))
             for i, (t, k, p) in enumerate(combos) for j in range(3)]
    sl = torch.randn(len(sseqs), 500, generator=gen) * 3
    noise = torch.stack([race_noise(s, s.num_output_tokens, 500) for s in sseqs])
    args = (torch.tensor([s.params.temperature for s in sseqs], dtype=torch.float32),
            torch.tensor([s.params.top_k if s.params.uses_top_k else 0 for s in sseqs], dtype=torch.int32),
            torch.tensor([s.params.top_p for s in sseqs], dtype=torch.float32),
            torch.tensor([s.seed for s in sseqs], dtype=torch.int64),
            torch.tensor([s.num_output_tokens for s in sseqs], dtype=torch.int32))
    cases.append(Case("sampling.sample (host noise)", (sl, *args, noise),
                      lambda L, x, t, k, p, sd, pos, nz: sampling.sample(L, x, t, k, p, sd, pos, noise=nz,
                                                                         tile=128).long(),
                      Sampler().sample_random(sl, sseqs).long(), ("equal",)))
    # a grammar's bitmask on two of three rows (the host's C mask), and top-8 log-probs (log_softmax's top-k)
    ml = torch.randn(3, 700, generator=gen) * 3
    bits = torch.randint(-2**31, 2**31 - 1, (2, 22), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([2, 0])
    masked = ml.clone()
    _ops.mask_rows_bits(masked.numpy(), rows.numpy(), bits.numpy(), 700, 22, 1)
    cases.append(Case("sampling.mask_bits f32", (ml, rows, bits),
                      lambda L, x, r, b: (sampling.mask_bits(L, x, r, b, tile=128), x)[1], masked, ("equal",)))
    picked = torch.tensor([3, 650, 7, 1, 0, 699], dtype=torch.int32)
    lp = torch.log_softmax(logits, -1)
    top = torch.sort(lp, dim=-1, descending=True, stable=True)
    cases.append(Case("sampling.top_logprobs ids", (logits, picked),
                      lambda L, x, t: sampling.top_logprobs(L, x, t, 8, tile=128)[2].long(), top.indices[:, :8],
                      ("equal",)))
    flat = lambda *tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    cases.append(Case("sampling.top_logprobs values", (logits, picked),
                      lambda L, x, t: flat(*sampling.top_logprobs(L, x, t, 8, tile=128)[:2]),
                      flat(lp.gather(1, picked.long()[:, None]), top.values[:, :8]),
                      ("abs", 1e-5)))
    return cases


def all_cases() -> list[Case]:
    return (_row_cases() + [_kv_write_case(torch.float32, 1.0), _kv_write_case(torch.bfloat16, 1.0),
                            _kv_write_case(torch.float8_e4m3fn, 0.0625), _rope_kv_case(),
                            _paged_case(torch.float32, torch.float32, 1.0, 0),
                            _paged_case(torch.bfloat16, torch.bfloat16, 1.0, 1),
                            _paged_case(torch.float32, torch.float8_e4m3fn, 0.02, 2),
                            _paged_case(torch.float32, torch.float32, 1.0, 3, splits=6),
                            _paged_case(torch.bfloat16, torch.float8_e4m3fn, 0.02, 4, splits=16)]
            + _gemm_cases() + _sampling_cases())


def compare(got: torch.Tensor, expected: torch.Tensor, check: tuple) -> tuple[bool, float, str]:
    """(within tolerance, max |difference| over entries both have finite, the tolerance in words)."""
    got, expected = got.cpu(), expected.cpu()
    if got.shape != expected.shape:
        return False, math.inf, f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    both = got.double().isfinite() & expected.double().isfinite()
    diff = (got.double() - expected.double()).abs()[both]
    err = float(diff.max()) if diff.numel() else 0.0
    kind = check[0]
    if kind == "bits":
        return torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), err, "bit-exact"
    if kind == "equal":
        return torch.equal(got, expected), err, "exact"
    same_gaps = torch.equal(got.double().isnan(), expected.double().isnan())
    if kind == "abs":
        return same_gaps and err <= check[1], err, f"abs <= {check[1]:.2e}"
    ok = torch.allclose(got.double(), expected.double(), rtol=check[1], atol=check[2], equal_nan=True)
    return ok, err, f"rtol {check[1]:.1e}, atol {check[2]:.0e}"


def run_all(compute_capability: str, interpret: bool, log=print) -> list[dict]:
    """One row per case: name, variants, ok, max_err, tolerance (or error)."""
    from builder.targets.cuda.compile import compile_variant, find_triton
    from runtime.backends.cuda.launch import (
        CubinLauncher,
        InterpreterLauncher,
        RecordingLauncher,
    )

    find_triton()
    device = torch.device("cpu" if interpret else "cuda")
    compiled: dict = {}
    rows = []

    def placed(inputs):
        return [a.clone() if isinstance(a, torch.Tensor) and interpret else a.to(device) if isinstance(a, torch.Tensor)
                else a for a in inputs]

    for case in all_cases():
        row = {"kernel": case.name}
        try:
            recorder = RecordingLauncher()
            case.run(recorder, *placed(case.inputs))
            for key, variant in recorder.seen.items():
                if key not in compiled:
                    compiled[key] = compile_variant(recorder.kernels[key], variant, compute_capability)
            mine = {k: compiled[k] for k in recorder.seen}
            launcher = InterpreterLauncher(allowed=set(mine)) if interpret else CubinLauncher(mine, device)
            got = case.run(launcher, *placed(case.inputs))
            if not interpret:
                torch.cuda.synchronize()
            ok, err, tol = compare(got, case.expected, case.check)
            row.update(variants=len(mine), ok=ok, max_err=err, tolerance=tol)
        except Exception as exc:  # noqa: BLE001 - one case's failure is a row, not the end of the section
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        log(f"  {case.name}: {'pass' if row['ok'] else 'FAIL'} {row.get('max_err', row.get('error'))}")
        rows.append(row)
    return rows
