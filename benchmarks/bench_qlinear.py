"""Linear kernels on the SmolLM2-135M layer shapes, side by side in one run: time per layer and GB/s.

    python benchmarks/bench_qlinear.py [--tokens 1,8,32,256] [--layers 30] [--threads 2] [--isa amx|avx512|...]

A "layer" is the four linears Kiln runs per decoder layer after fusion: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536. `--layers` distinct copies of the weights are cycled through, so
with the default 30 (the model's depth) the weights stream from DRAM as in real decoding; with
`--layers 1` they stay in cache. GB/s = weight bytes read per layer / time per layer. The lm_head
(49152x576, tied embedding) is timed apart. Times per layer are wall clock: the sum of each call's
best time over --rounds passes through all layers, in model order, and in brackets the median pass
(the machine may be shared; the median shows the noise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from runtime.ops import linear
from runtime.weights import bf16, fp8, int4, int5, int6, int8

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def random_int4(n: int, k: int, g: int):
    """Q4_1-like weights: f16 scale d and min m, zero = m + 8d (packs to the compact f16 form)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // g) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(n, k // g) * 1e-3).half().float()
    return q, d, m + 8 * d


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Method:
    """One way to run a linear: make(shape, seed) -> (fn(x) -> y, bytes of weights)."""

    def __init__(self, name: str, make):
        self.name, self.make = name, make


def methods(group: int, threads: int) -> list[Method]:
    def f32_linear(n, k):
        w = torch.randn(n, k) * 0.02
        return (lambda x: F.linear(x, w)), tensor_bytes([w])

    def torch_int4pack(n, k):
        q, s, z = random_int4(n, k, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
        scale_zero = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/G, N, 2]: same (q-8)*s+z convention
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero)), \
            tensor_bytes([packed, scale_zero])

    def kiln_int4(act):
        def make(n, k):
            packed = int4.pack(*random_int4(n, k, group), group)
            bound = linear.bind(int4.FORMAT, packed, n, k, group, act=act)
            return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())
        return make

    def kiln_int8(act, g):
        def make(n, k):
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            s = (torch.rand(n) if g is None else torch.rand(n, k // g)).half().float() * 1e-3
            packed = int8.pack(q, s, g)
            bound = linear.bind(int8.FORMAT, packed, n, k, g, act=act)
            return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())
        return make

    def kiln_int5(n, k):  # Q5_0-like: f16 d, min -16d (packs to f16 scales and mins)
        q = torch.randint(0, 32, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half().float()
        packed = int5.pack(q, d, -16 * d, 32)
        bound = linear.bind(int5.FORMAT, packed, n, k, 32)
        return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())

    def kiln_int6(n, k):  # Q6_K-like: group 16, f32 scales d * sc
        q = torch.randint(0, 64, (n, k), dtype=torch.uint8)
        packed = int6.pack(q, torch.rand(n, k // 16) * 1e-3, 16)
        bound = linear.bind(int6.FORMAT, packed, n, k, 16)
        return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())

    def kiln_fp8(n, k):
        packed = fp8.pack((torch.randn(n, k) * 8).to(torch.float8_e4m3fn), torch.rand(n) * 1e-3)
        bound = linear.bind(fp8.FORMAT, packed, n, k)
        return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())

    def kiln_bf16(n, k):
        packed = bf16.pack(torch.randn(n, k) * 0.02)
        bound = linear.bind(bf16.FORMAT, packed, n, k)
        return (lambda x: bound(x, num_threads=threads)), tensor_bytes(packed.values())

    return [
        Method("torch f32 F.linear", f32_linear),
        Method(f"torch int4pack g{group}", torch_int4pack),
        Method(f"kiln int4 g{group} act=f32", kiln_int4("f32")),
        Method(f"kiln int4 g{group} act=int8", kiln_int4("int8")),
        Method(f"kiln int4 g{group} act=int16", kiln_int4("int16")),
        Method(f"kiln int4 g{group} act=int12", kiln_int4("int12")),
        Method("kiln int8/ch act=f32", kiln_int8("f32", None)),
        Method("kiln int8/ch act=int8", kiln_int8("int8", None)),
        Method("kiln int8/ch act=int16", kiln_int8("int16", None)),
        Method("kiln int8 g32 (Q8_0) f32", kiln_int8("f32", 32)),
        Method("kiln int8 g32 (Q8_0) int8", kiln_int8("int8", 32)),
        Method("kiln int8 g32 (Q8_0) int16", kiln_int8("int16", 32)),
        Method("kiln int5 g32 (Q5_0) f32", kiln_int5),
        Method("kiln int6 g16 (Q6_K) f32", kiln_int6),
        Method("kiln fp8 e4m3 act=f32", kiln_fp8),
        Method("kiln bf16 act=f32", kiln_bf16),
    ]


def time_stack(layers: list[list], xs: dict, rounds: int) -> tuple[float, float]:
    """Seconds per layer: the sum of each call's best time over `rounds` passes through all layers
    (calls still run in model order, so caches hold what they would), and the median pass."""
    calls = [(name, fn) for fns in layers for name, fn in fns]
    for name, fn in calls[:8]:
        fn(xs[name])
    best = [float("inf")] * len(calls)
    passes = []
    clock = time.perf_counter
    for _ in range(rounds):
        pass_start = clock()
        for i, (name, fn) in enumerate(calls):
            start = clock()
            fn(xs[name])
            best[i] = min(best[i], clock() - start)
        passes.append(clock() - pass_start)
    return sum(best) / len(layers), statistics.median(passes) / len(layers)


def bench_layers(args, method: Method) -> dict[int, str]:
    layers, layer_bytes = [], 0
    for _ in range(args.layers):
        fns = []
        for name, (n, k) in LAYER_SHAPES.items():
            fn, nbytes = method.make(n, k)
            fns.append((name, fn))
            layer_bytes += nbytes
        layers.append(fns)
    layer_bytes /= args.layers
    cells = {}
    for t in args.tokens:
        xs = {name: torch.randn(t, k) for name, (n, k) in LAYER_SHAPES.items()}
        rounds = max(3, min(args.rounds, int(args.rounds * 8 / t) + 1))
        best, median = time_stack(layers, xs, rounds)
        cells[t] = f"{best * 1e6:8.0f} [{median * 1e6:6.0f}] {layer_bytes / best / 1e9:5.1f}"
    return cells


def bench_lm_head(args, method: Method) -> dict[int, str]:
    n, k = LM_HEAD
    fn, nbytes = method.make(n, k)
    cells = {}
    for t in (1, 8, 32):
        x = torch.randn(t, k)
        best, median = time_stack([[("x", fn)]], {"x": x}, args.rounds)
        cells[t] = f"{best * 1e6:8.0f} [{median * 1e6:6.0f}] {nbytes / best / 1e9:5.1f}"
    return cells


def bench_interleaved(args, group: int) -> None:
    """A decode-like layer (T=1): torch glue ops (rms_norm, silu_mul, adds, a torch matmul standing in
    for attention) between the four int4 linears, against each part alone. Both use OpenMP; extra
    time when mixed would come from thread pools fighting (spinning workers)."""
    layers = []
    for _ in range(args.layers):
        bound = {}
        for name, (n, k) in LAYER_SHAPES.items():
            bound[name] = linear.bind(int4.FORMAT, int4.pack(*random_int4(n, k, group), group), n, k, group)
        layers.append(bound)
    h, norm_w, keys = torch.randn(1, 576), torch.rand(576), torch.randn(9, 64, 256)
    query, act = torch.randn(9, 1, 64), torch.randn(1, 1536)

    def glue(x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
        scores = torch.softmax(torch.bmm(query, keys) / 8, dim=-1)  # [9 heads, 1, 256 positions]
        return x + scores.sum() * 1e-6

    def linears(bound):
        bound["qkv"](h), bound["o"](h), bound["gate_up"](h), bound["down"](act)

    def mixed(bound):
        x = glue(h)
        bound["qkv"](x)
        x = glue(bound["o"](h))
        up = bound["gate_up"](x)
        bound["down"](torch.nn.functional.silu(up[:, :1536]) * up[:, 1536:])

    def per_layer(fn):
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for bound in layers:
                fn(bound)
            best = min(best, (time.perf_counter() - start) / len(layers))
        return best

    for fn in (linears, mixed):
        fn(layers[0])
    kern = per_layer(linears)
    torch_only = per_layer(lambda bound: (glue(h), glue(h)))
    both = per_layer(mixed)
    print(f"\ndecode-like layer mix (T=1, {torch.get_num_threads()} threads, best pass): kiln linears "
          f"{kern * 1e6:.0f} us + torch glue {torch_only * 1e6:.0f} us = {(kern + torch_only) * 1e6:.0f} us; "
          f"interleaved {both * 1e6:.0f} us")


def print_table(title: str, rows: dict[str, dict[int, str]], tokens) -> None:
    print(f"\n{title}\n{'method':28s}" + "".join(f"{'T=' + str(t) + ': us [median] GB/s':>29s}" for t in tokens))
    for name, cells in rows.items():
        print(f"{name:28s}" + "".join(f"{cells[t]:>29s}" for t in tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,256", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated substrings of method names to run")
    parser.add_argument("--no-mix", action="store_true", help="skip the decode-like layer mix")
    parser.add_argument("--isa", default="auto", choices=("auto", "amx", "avx512", "avx2", "portable"),
                        help="the kernels to time (default: the fastest this CPU runs)")
    args = parser.parse_args()
    try:
        linear.set_isa(args.isa)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads} layers={args.layers} kernels={linear.isa()} torch={torch.__version__}")
    chosen = [m for m in methods(args.group, args.threads)
              if not args.only or any(s in m.name for s in args.only.split(","))]
    rows = {m.name: bench_layers(args, m) for m in chosen}
    print_table(f"SmolLM2-135M layer (qkv, o, gate_up, down), {args.layers} distinct layers", rows, args.tokens)
    heads = [m for m in chosen if "int4" not in m.name or "kiln" in m.name]
    print_table("lm_head 49152x576", {m.name: bench_lm_head(args, m) for m in heads}, (1, 8, 32))
    if not args.no_mix:
        bench_interleaved(args, args.group)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
