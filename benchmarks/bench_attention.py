"""Decode attention against memory bandwidth: how fast the paged attention kernel streams the KV cache.

    python benchmarks/bench_attention.py [--contexts 128,512,2048,8192] [--batch 1,8] [--dtypes f16,f32]
        [--threads 2] [--layers 30] [--rounds 5]

One decode step's attention at SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, blocks of 16): each
of --batch sequences has one query and --contexts cached tokens. --layers distinct caches are cycled through,
as a step's layers are, so the KV streams from memory rather than staying in a core's cache. For each case it
prints the time per layer (best round [median]), the KV bytes read per layer (K and V of every cached token)
over that time, and that rate as a share of the read bandwidth measured in the same run on the same threads
(torch summing a buffer larger than the KV of all layers). Each call goes through the Python binding (a few
microseconds a call, which a replayed step does not pay), so short contexts understate the kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from runtime.ops import attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}


def read_bandwidth(threads: int, nbytes: int, rounds: int) -> float:
    """Bytes per second torch.sum reads on `threads` threads (best of rounds)."""
    torch.set_num_threads(threads)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def case(context: int, batch: int, dtype: torch.dtype, layers: int, threads: int, rounds: int):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(layers)]
    tables = torch.arange(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty(batch, HEADS, HEAD_DIM)
    passes = []
    for _ in range(rounds):
        started = time.perf_counter()
        for k_cache, v_cache in caches:
            attention.paged_attention(out, query, k_cache, v_cache, tables, context_lens, query_start_loc,
                                      HEAD_DIM ** -0.5, num_threads=threads, check=False)
        passes.append((time.perf_counter() - started) / layers)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
    return min(passes), statistics.median(passes), kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,512,2048,8192")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--dtypes", default="f16,f32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    largest = max(int(c) for c in args.contexts.split(",")) * max(int(b) for b in args.batch.split(","))
    kv_all = 2 * largest * KV_HEADS * HEAD_DIM * 4 * args.layers
    bandwidth = read_bandwidth(args.threads, max(1 << 30, 2 * kv_all), args.rounds)
    print(f"read bandwidth (torch.sum, {args.threads} threads): {bandwidth / 1e9:.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| KV dtype | batch | context | µs per layer, best [median] | KV read GB/s | share of read bandwidth |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                best, median, kv_bytes = case(context, batch, DTYPES[dtype], args.layers, args.threads,
                                              args.rounds)
                rate = kv_bytes / best
                print(f"| {dtype} | {batch} | {context} | {best * 1e6:.1f} [{median * 1e6:.1f}] | {rate / 1e9:.1f} | "
                      f"{rate / bandwidth:.0%} |", flush=True)


if __name__ == "__main__":
    main()
