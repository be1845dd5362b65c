"""This machine's measured limits, and where an engine's steps stand against them.

`measure_peaks` times four micro-benchmarks on the threads a run uses (best of a few repeats, so
a figure is what the machine can do, not what a noisy moment gave):

- memory read bandwidth: summing a 256 MiB f32 buffer (far larger than any cache);
- f32: independent chains of the kernels' FMA instruction on registers (`_qlinear.peak`: AVX-512
  where the qlinear kernels use it, else AVX2);
- int8: the same with the int8 dot-product instruction (AVX-512 VNNI vpdpbusd, else AVX2
  vpmaddubsw);
- int16: the same with the int16 pair-product instruction (AVX-512 VNNI vpdpwssd, twice the f32
  FMA's operations; else AVX2 vpmaddwd and the vpaddd that accumulates it).

Where the qlinear kernels use AMX tiles (the larger steps), the peaks stay the AVX-512 instructions':
the steps of few tokens run on those, and the tiled ones are bound by the f32 work after every
block's tile multiplies, far below the tile unit's own peak. So on such a CPU an f32 step of 13
tokens or more can exceed 100% of the f32 FMA peak: its multiplies run on the tiles (three bf16
multiplies a product, see runtime/_native/qlinear/amx.c).

A decoder step reads every weight once (a mixture of experts: the experts its tokens chose, see
runtime/measure/bench.py) and does two operations per weight per token, so for
`tokens_per_s` tokens at `steps_per_s` steps: bandwidth used = steps_per_s x weight bytes, and
compute used = 2 x linear parameters x tokens_per_s. `roofline` puts both beside the peaks; the
larger share is the limit the step runs against.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from runtime._native import _qlinear

READ_BYTES = 256 << 20
PEAK_ITERS = 10_000_000  # rounds of the instruction loops: tens of milliseconds each
REPEATS = 5


@dataclass(frozen=True)
class Peaks:
    threads: int
    read_gbs: float      # GB/s, 1e9 bytes
    f32_gflops: float    # 1e9 f32 operations/s (a multiply-add is two), the FMA instruction's
    int8_gops: float     # 1e9 int8 operations/s, the int8 dot-product instruction's
    int16_gops: float    # 1e9 int16 operations/s, the int16 pair-product instruction's

    def to_dict(self) -> dict:
        return asdict(self)


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: first-touch pages, thread pools
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _read_seconds() -> float:
    """Best time to sum READ_BYTES of f32 (the buffer is freed on return)."""
    buffer = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    return _best(lambda: buffer.sum())


@torch.inference_mode()
def measure_peaks(threads: int | None = None) -> Peaks:
    """The four micro-benchmarks on `threads` threads (default: torch's current count)."""
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        read = _read_seconds()
    finally:
        torch.set_num_threads(before)
    f32, int8, int16 = (max(_qlinear.peak(kind, threads, PEAK_ITERS) for _ in range(REPEATS)) for kind in (0, 1, 2))
    return Peaks(threads, READ_BYTES / read / 1e9, f32 / 1e9, int8 / 1e9, int16 / 1e9)


def linear_parameters(config: dict) -> tuple[int, int]:
    """(parameters of the decoder layers' linears, of the logits) of a model config as the manifest
    records it: the multiply-adds one token costs in each."""
    hidden, layers = config["hidden_size"], config["num_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_heads"]
    q = config["num_heads"] * head_dim
    kv = config["num_kv_heads"] * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    moe_layers = set(config.get("moe_layers") or ())
    # a token of a mixture layer runs the router, its top-k experts and the shared expert (with its gate)
    moe = (hidden * config.get("num_experts", 0) + 3 * hidden * config.get("expert_intermediate_size", 0)
           * config.get("experts_per_token", 0) + 3 * hidden * config.get("shared_expert_intermediate_size", 0)
           + (hidden if config.get("shared_expert_intermediate_size") else 0))
    mlps = sum(moe if i in moe_layers else 3 * hidden * config["intermediate_size"] for i in range(layers))
    return attention * layers + mlps, hidden * config["vocab_size"]


def roofline(weight_gbs: float, gops: float, peaks: Peaks, activations: str) -> tuple[float, float, str]:
    """(share of the read bandwidth, share of the compute peak, the limit that applies): each
    activation mode is held to the peak of its own instruction."""
    kind = "int16" if activations == "int12" else activations  # int12 runs int16's instructions
    kind = kind if kind in ("int8", "int16") else "f32"
    memory = weight_gbs / peaks.read_gbs
    compute = gops / {"int8": peaks.int8_gops, "int16": peaks.int16_gops, "f32": peaks.f32_gflops}[kind]
    return memory, compute, ("memory" if memory >= compute else kind)
