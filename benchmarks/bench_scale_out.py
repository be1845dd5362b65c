"""Scale-out side by side: colocated vs prefill/decode-disaggregated serving, and 1 vs 2 replicas.

    python benchmarks/bench_scale_out.py [ENGINE] [--seconds 30] [--rounds 1] [--json out.json]

Mixed load (what disaggregation is for): 8 clients stream short-prompt answers back to back
(max_tokens 128) while another sends a long prompt (~1500 tokens, max_tokens 8) every 3 seconds,
for --seconds. Reported per server: the streaming answers' TTFT and inter-token latency (p50/p99,
client-side, gaps between streamed chunks), the long prompts' TTFT, and output tokens/s. Servers:
`engine-run serve` colocated (one engine, every core), `--replicas 2` and `--disaggregate 1:1` (two
engines, cores split between them).

Throughput: 64 requests (max_tokens 128), 32 in flight, on `--replicas 1 --max-replicas 1` (one engine
on Ray Serve, so both sides pay the same proxy hops) and `--replicas 2`.

Each server starts on a free port, is measured and stopped before the next starts; --rounds N
interleaves them N times. On a 2-core host every configuration shares the same two cores, so more
engines split the compute rather than add to it: the figures show the overheads and the isolation
of decode from prefill, not the gains of more machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from bench_serving import Result, free_port, one_request, percentile, running_server  # noqa: E402

TOPICS = ["the sea", "a lighthouse keeper", "mountain trains", "a city at night", "old maps", "bees",
          "a clockmaker", "winter gardens"]
LONG = ("The committee met in the old library to review the archive's catalogue, shelf by shelf, noting "
        "which volumes had been rebound, which were missing their indexes, and which needed new labels. ")


async def mixed_load(url: str, model: str, seconds: float) -> dict:
    stream_results: list[Result] = []
    long_results: list[Result] = []
    deadline = time.perf_counter() + seconds

    async def streamer(http, k):
        i = 0
        while time.perf_counter() < deadline:
            body = {"model": model, "prompt": f"Write a long story about {TOPICS[k]} (part {i}).\n\n",
                    "max_tokens": 128, "temperature": 0, "stream": True, "ignore_eos": True}
            stream_results.append(await one_request(http, body))
            i += 1

    async def long_prompts(http):
        i = 0
        while time.perf_counter() < deadline:
            body = {"model": model, "prompt": f"Report {i}. " + LONG * 40 + "\nSummary:", "max_tokens": 8,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            started = time.perf_counter()
            long_results.append(await one_request(http, body))
            i += 1
            await asyncio.sleep(max(0.0, 3.0 - (time.perf_counter() - started)))

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=16)) as http:
        await asyncio.gather(long_prompts(http), *(streamer(http, k) for k in range(8)))
    wall = time.perf_counter() - start
    ok = [r for r in stream_results if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    long_ttft = [r.ttft for r in long_results if r.error is None and r.ttft is not None]
    tokens = sum(r.tokens for r in ok) + sum(r.tokens for r in long_results if r.error is None)
    return {"streams": len(stream_results), "stream_errors": len(stream_results) - len(ok),
            "long_prompts": len(long_results), "long_errors": sum(r.error is not None for r in long_results),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99),
            "long_ttft_p50": percentile(long_ttft, 0.5) if long_ttft else float("nan"),
            "output_tok_s": tokens / wall}


async def throughput(url: str, model: str) -> dict:
    limit = asyncio.Semaphore(32)

    async def one(http, i):
        async with limit:
            return await one_request(http, {"model": model, "prompt": f"Tell me about {TOPICS[i % 8]} ({i}).\n",
                                             "max_tokens": 128, "temperature": 0, "stream": True,
                                             "ignore_eos": True})

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=40)) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, i) for i in range(64)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    return {"requests": len(results), "errors": len(results) - len(ok),
            "output_tok_s": sum(r.tokens for r in ok) / wall}


def serve(engine: str, name: str, args: list[str], log_dir: str):
    port = free_port()
    command = [sys.executable, "-m", "runtime.cli", "serve", engine, "--port", str(port), "--model-name", "m",
               *args]
    return f"http://127.0.0.1:{port}", running_server(name, command, f"http://127.0.0.1:{port}/health", log_dir)


MIXED = {"colocated": [], "replicas=2": ["--replicas", "2"], "disaggregated 1:1": ["--disaggregate", "1:1"]}
THROUGHPUT = {"replicas=1": ["--replicas", "1", "--max-replicas", "1"], "replicas=2": ["--replicas", "2"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", nargs="?", default="engines/smollm2-135m")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--log-dir", default="/tmp/bench_scale_out")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    mixed: dict[str, list[dict]] = {name: [] for name in MIXED}
    through: dict[str, list[dict]] = {name: [] for name in THROUGHPUT}
    for round_ in range(args.rounds):
        for name, extra in MIXED.items():
            url, server = serve(args.engine, f"mixed-{len(mixed[name])}-{name.split()[0]}", extra, args.log_dir)
            with server:
                mixed[name].append(asyncio.run(mixed_load(url, "m", args.seconds)))
            print(f"round {round_ + 1} mixed {name}: {json.dumps(mixed[name][-1])}", flush=True)
        for name, extra in THROUGHPUT.items():
            url, server = serve(args.engine, f"throughput-{len(through[name])}-{name}", extra, args.log_dir)
            with server:
                asyncio.run(throughput(url, "m"))  # warm-up: first-use costs stay out of the figure
                through[name].append(asyncio.run(throughput(url, "m")))
            print(f"round {round_ + 1} throughput {name}: {json.dumps(through[name][-1])}", flush=True)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\nMixed load, {args.seconds:.0f} s: 8 streaming clients (128 tokens) + a ~1500-token prompt every 3 s; "
          f"medians of {args.rounds} round(s), ms")
    print(f"{'server':<20}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'long TTFT':>11}"
          f"{'tok/s':>8}{'errors':>8}")
    for name, rows in mixed.items():
        errors = sum(r["stream_errors"] + r["long_errors"] for r in rows)
        print(f"{name:<20}" + "".join(f"{1000 * med(rows, k):>10.0f}" for k in ("ttft_p50", "ttft_p99", "itl_p50",
                                                                                  "itl_p99"))
              + f"{1000 * med(rows, 'long_ttft_p50'):>11.0f}{med(rows, 'output_tok_s'):>8.1f}{errors:>8}")
    print("\nThroughput: 64 requests x 128 tokens, 32 in flight")
    for name, rows in through.items():
        print(f"{name:<20}{med(rows, 'output_tok_s'):>8.1f} tok/s  errors {sum(r['errors'] for r in rows)}")
    base = med(through["replicas=1"], "output_tok_s")
    print(f"replicas=2 / replicas=1: {med(through['replicas=2'], 'output_tok_s') / base:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"mixed": mixed, "throughput": through}, indent=1))


if __name__ == "__main__":
    main()
