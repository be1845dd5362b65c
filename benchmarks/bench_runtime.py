"""Offline throughput of a Kiln engine beside Hugging Face transformers, same model, same run.

    python benchmarks/bench_runtime.py [--engine engines/smollm2-135m] [--requests 32]
        [--prompt-len 128] [--output-len 128] [--max-num-tokens N] [--no-transformers]

Reports prefill and decode tokens/s, time to first token and inter-token latency percentiles,
for one sequence and for N concurrent requests; transformers runs `generate` on the model the
engine was built from (float32), greedy, with the same lengths.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from runtime.engine import EngineOptions, LLMEngine
from runtime.sampling import SamplingParams


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def synthetic_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_kiln(llm: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    arrival = {llm.add_request(p, params): start for p in prompts}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    prefill_done = None
    while llm.has_unfinished():
        outputs = llm.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if rid not in first:
                first[rid] = now
            else:
                gaps.append(now - last[rid])
            last[rid] = now
        if prefill_done is None and len(first) == len(prompts):
            prefill_done = now
    elapsed = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in arrival]
    prompt_tokens = sum(map(len, prompts))
    decode_time = elapsed - (prefill_done - start)
    return {
        "elapsed_s": elapsed,
        "output_tok_s": len(prompts) * output_len / elapsed,
        "prefill_tok_s": prompt_tokens / (prefill_done - start),
        "decode_tok_s": len(prompts) * (output_len - 1) / decode_time if decode_time > 0 else float("nan"),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
    }


def run_transformers(model, prompts: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids[:, :], max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    n = len(prompts)
    return {
        "elapsed_s": elapsed,
        "output_tok_s": n * output_len / elapsed,
        "prefill_tok_s": ids.numel() / prefill,
        "decode_tok_s": n * (output_len - 1) / max(elapsed - prefill, 1e-9),
        "ttft_p50_ms": 1e3 * prefill, "ttft_p99_ms": 1e3 * prefill,
        "itl_p50_ms": 1e3 * (elapsed - prefill) / (output_len - 1), "itl_p99_ms": float("nan"),
    }


def weight_bytes(engine: Path) -> int:
    manifest = json.loads((engine / "manifest.json").read_text())
    return sum(r["weight_bytes"] for r in manifest["memory"]["ranks"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-tokens", type=int, default=None,
                        help="lower the engine's tokens per step (default: the plan's)")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    llm = LLMEngine.from_dir(args.engine, EngineOptions(kv_cache_gib=1.0, max_num_tokens=args.max_num_tokens))
    vocab = llm.engine.manifest["model"]["config"]["vocab_size"]
    single = synthetic_prompts(1, 32, vocab)
    batch = synthetic_prompts(args.requests, args.prompt_len, vocab, seed=1)
    run_kiln(llm, synthetic_prompts(1, 8, vocab, seed=2), 4)  # warm up caches and threads
    rows = {"kiln 1 seq": run_kiln(llm, single, args.output_len),
            f"kiln {args.requests} seqs": run_kiln(llm, batch, args.output_len)}
    if args.transformers:
        from builder.verify import load_transformers_model

        model = load_transformers_model(llm.engine.manifest["model"]["source"])
        rows["transformers 1 seq"] = run_transformers(model, single, args.output_len)
        rows[f"transformers {args.requests} seqs"] = run_transformers(model, batch, args.output_len)

    keys = ["output_tok_s", "prefill_tok_s", "decode_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    print(f"engine {args.engine}  threads {torch.get_num_threads()}  prompt {args.prompt_len}  "
          f"output {args.output_len}  requests {args.requests}  max_num_tokens {llm.limits['max_num_tokens']}")
    print(f"{'':24}" + "".join(f"{k:>15}" for k in keys))
    for name, row in rows.items():
        print(f"{name:24}" + "".join(f"{row[k]:15.1f}" for k in keys))
    gb = weight_bytes(args.engine) / 1e9
    one = rows["kiln 1 seq"]["decode_tok_s"]
    print(f"kiln single-sequence decode reads {gb:.3f} GB of weights per token: {one * gb:.1f} GB/s achieved")
    if args.transformers:
        for label in ("1 seq", f"{args.requests} seqs"):
            ratio = rows[f"kiln {label}"]["output_tok_s"] / rows[f"transformers {label}"]["output_tok_s"]
            print(f"kiln / transformers output tokens/s, {label}: {ratio:.2f}x")
        ratio = one / rows["transformers 1 seq"]["decode_tok_s"]
        print(f"kiln / transformers single-sequence decode tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
