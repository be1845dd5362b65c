"""Kiln's cuda kernels one shape at a time on a GPU: a decode step's linears at Llama-3.1-8B's shapes and decode
attention at several context lengths, each beside the device's copy bandwidth. Minutes, no engine build: the
variants are compiled for the GPU here (the build's compile_variant) and launched through CubinLauncher.

    python benchmarks/gpu_kernels_bench.py [--tokens 1,2,8,16] [--contexts 150,1024,4096,16384] [--batches 1,8]
        [--out FILE.json]
    python benchmarks/gpu_kernels_bench.py --interpret   # tiny shapes in Triton's interpreter: that it runs, no speed

Linears (K -> N: qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096, lm_head 4096 ->
128256), random weights: torch's bf16 matmul (cuBLAS), Kiln fp8 weight-only, Kiln int4 weight-only (groups of 128).
Attention: 32 query heads on 8 KV heads of 128, a bf16 cache in blocks of 16: `paged_attention` (one program per
sequence and KV head) against `decode_attention` (the context split over the multiprocessors). Each row: time per
call (CUDA events around 50 calls after 5), bytes read per call (weights, or K and V) / time, that as a share of
the copy bandwidth, and the largest difference from torch on the same inputs, relative to the largest value.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
           "lm_head": (4096, 128256)}
TINY_LINEARS = {"tiny": (256, 48)}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


class Kernels:
    """Launch through cubins compiled here for this GPU (or the interpreter), each variant compiled once."""

    def __init__(self, interpret: bool):
        from builder.targets.cuda.compile import find_triton

        find_triton()
        self.interpret = interpret
        self.device = torch.device("cpu" if interpret else "cuda")
        self.compiled: dict = {}
        if interpret:
            self.cc = "9.0"
        else:
            major, minor = torch.cuda.get_device_capability()
            self.cc = f"{major}.{minor}"

    def launcher(self, run):
        """A launcher holding every variant run(launcher) asks for."""
        from builder.targets.cuda.compile import compile_variant
        from runtime.backends.cuda.launch import CubinLauncher, InterpreterLauncher, RecordingLauncher

        recorder = RecordingLauncher()
        run(recorder)
        for key, variant in recorder.seen.items():
            if key not in self.compiled:
                self.compiled[key] = compile_variant(recorder.kernels[key], variant, self.cc)
        mine = {k: self.compiled[k] for k in recorder.seen}
        return InterpreterLauncher(allowed=set(mine)) if self.interpret else CubinLauncher(mine, self.device)


def timed(fn, interpret: bool, calls: int = 50) -> float:
    """Seconds per call (the interpreter: one call, timed on the host)."""
    if interpret:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.float(), expected.float()
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def linear_rows(kernels: Kernels, shapes: dict, tokens: list[int], bandwidth: float) -> list[dict]:
    from runtime.backends.cuda.kernels import gemm

    dev, gen, rows = kernels.device, torch.Generator().manual_seed(0), []
    for name, (k, n) in shapes.items():
        codes = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, generator=gen)  # e4m3 without NaN, both signs:
        codes |= torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=gen) << 7
        fp8 = codes.view(torch.float8_e4m3fn).to(dev)
        fp8_scales = (torch.rand(n, generator=gen) / 256).to(dev)
        q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        packed = gemm.pack_int4(q4).to(dev)
        s4 = (torch.rand(n, k // 128, generator=gen) / 64).to(dev)
        z4 = (torch.randn(n, k // 128, generator=gen) / 64).to(dev)
        w_bf16 = (fp8.float() * fp8_scales[:, None]).to(torch.bfloat16)
        w_int4 = ((q4.to(dev).float() - 8) * s4.repeat_interleave(128, 1) + z4.repeat_interleave(128, 1))
        for t in tokens:
            x = torch.randn(t, k, generator=gen).to(torch.bfloat16).to(dev)
            calls = {"torch bf16": (lambda ln: x @ w_bf16.T, n * k * 2, x.float() @ w_bf16.float().T),
                     "Kiln fp8": (lambda ln: gemm.linear_fp8(ln, x, fp8, fp8_scales), n * k + 4 * n,
                                  x.float() @ (fp8.float() * fp8_scales[:, None]).T),
                     "Kiln int4 g128": (lambda ln: gemm.linear_int4(ln, x, packed, s4, z4, 128),
                                        n * k // 2 + 8 * n * (k // 128), x.float() @ w_int4.T)}
            for label, (call, nbytes, expected) in calls.items():
                launcher = kernels.launcher(call) if label != "torch bf16" else None
                seconds = timed(lambda c=call, ln=launcher: c(ln), kernels.interpret)
                rows.append(row(f"{name} {k}->{n}", t, label, seconds, nbytes, bandwidth,
                                difference(call(launcher), expected)))
    return rows


def attention_rows(kernels: Kernels, contexts: list[int], batches: list[int], bandwidth: float,
                   heads=(HEADS, KV_HEADS, HEAD_DIM)) -> list[dict]:
    from runtime.backends.cuda.kernels import attention
    from runtime.ops.attention import paged_attention as native

    nh, nkv, hd = heads
    dev, gen, rows = kernels.device, torch.Generator().manual_seed(1), []
    sms = 4 if kernels.interpret else torch.cuda.get_device_properties(dev).multi_processor_count
    for batch in batches:
        for ctx in contexts:
            per = -(-ctx // BLOCK)
            k_cache = torch.randn(batch * per, BLOCK, nkv, hd, generator=gen).to(torch.bfloat16).to(dev)
            v_cache = torch.randn(batch * per, BLOCK, nkv, hd, generator=gen).to(torch.bfloat16).to(dev)
            tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per).to(dev)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            q = torch.randn(batch, nh * hd, generator=gen).to(torch.bfloat16).to(dev)
            expected = torch.empty(batch, nh, hd)
            native(expected, q.float().cpu().view(batch, nh, hd), k_cache.float().cpu(), v_cache.float().cpu(),
                   tables.cpu(), lens.cpu(), starts.cpu(), hd ** -0.5)
            splits = attention.decode_splits(batch, nkv, sms)
            out = torch.empty_like(q)
            calls = {"paged_attention": lambda ln: attention.paged_attention(
                         ln, out, q, k_cache, v_cache, tables, lens, starts, hd ** -0.5, num_heads=nh, max_query_len=1),
                     f"decode_attention ({splits} splits)": lambda ln: attention.decode_attention(
                         ln, out, q, k_cache, v_cache, tables, lens, starts, hd ** -0.5, num_heads=nh, splits=splits,
                         min_keys=attention.SPLIT_MIN_KEYS if not kernels.interpret else 16)}
            nbytes = 2 * batch * ctx * nkv * hd * 2
            for label, call in calls.items():
                launcher = kernels.launcher(call)
                seconds = timed(lambda c=call, ln=launcher: c(ln), kernels.interpret)
                rows.append(row(f"attention, context {ctx}", batch, label, seconds, nbytes, bandwidth,
                                difference(call(launcher).cpu().view(batch, nh, hd), expected)))
    return rows


def row(what: str, tokens: int, impl: str, seconds: float, nbytes: int, bandwidth: float | None, err: float) -> dict:
    """A printed row: time per call, bytes read / time, that against the copy bandwidth, the difference from torch."""
    r = {"what": what, "tokens": tokens, "impl": impl, "us": 1e6 * seconds, "GB/s": nbytes / seconds / 1e9,
         "share": nbytes / seconds / bandwidth if bandwidth else None, "rel err": err}
    share = "" if r["share"] is None else f", {100 * r['share']:.0f}% of copy bandwidth"
    print(f"{r['what']:>28} x{r['tokens']:<3} {r['impl']:<30} {r['us']:9.1f} us {r['GB/s']:8.1f} GB/s{share}"
          f" (rel err {r['rel err']:.1e})", flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--tokens", type=ints, default=[1, 2, 8, 16])
    parser.add_argument("--contexts", type=ints, default=[150, 1024, 4096, 16384])
    parser.add_argument("--batches", type=ints, default=[1, 8])
    parser.add_argument("--interpret", action="store_true", help="tiny shapes in Triton's interpreter on the CPU")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    if not args.interpret and not torch.cuda.is_available():
        raise SystemExit("gpu_kernels_bench: no CUDA device here; --interpret runs tiny shapes in the interpreter")
    kernels = Kernels(args.interpret)
    bandwidth = None
    if not args.interpret:
        from gpu_check_models import copy_bandwidth

        bandwidth = copy_bandwidth()
        print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    shapes = TINY_LINEARS if args.interpret else LINEARS
    contexts = [c for c in args.contexts if c <= 64] or [40] if args.interpret else args.contexts
    heads = (4, 2, 16) if args.interpret else (HEADS, KV_HEADS, HEAD_DIM)
    rows = linear_rows(kernels, shapes, args.tokens, bandwidth)
    rows += attention_rows(kernels, contexts, args.batches, bandwidth, heads)
    if args.out:
        args.out.write_text(json.dumps({"device": "interpreter" if args.interpret else torch.cuda.get_device_name(),
                                        "copy_bandwidth_gbs": bandwidth and bandwidth / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
