"""Offline throughput of a Kiln engine beside Hugging Face transformers, same model, same run.

    python benchmarks/bench_runtime.py [--engine engines/smollm2-135m] [--requests 32]
        [--prompt-len 128] [--output-len 128] [--max-num-tokens N] [--prefill-chunk N] [--no-transformers]

Kiln's side is `engine-run bench`'s measurement (runtime/measure/bench.py) at concurrency 1 and N, all N
requests at once, with no cap on prefill tokens beside decodes unless --prefill-chunk gives one: offline,
as `engine-run generate` runs a batch of prompts (a server's default, 64, keeps streams' inter-token
latency low instead); transformers runs `generate` on the model the engine was built from (float32),
greedy, on the same synthetic prompts, with the same lengths. Prints output tokens/s, time to first
token and inter-token latency for both, and their ratios.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from runtime.measure.bench import run_level, synthetic_prompts, table, weight_bytes
from runtime.core.engine import EngineOptions
from runtime.launcher import open_llm_engine


def run_transformers(model, prompts: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        start = time.perf_counter()
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    return {"output_tok_s": len(prompts) * output_len / elapsed, "ttft_ms": 1e3 * prefill,
            "itl_ms": 1e3 * (elapsed - prefill) / (output_len - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-tokens", type=int, default=None,
                        help="lower the engine's tokens per step (default: the plan's)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="prefill tokens per step while others decode (default 0: no cap, as generate's batch)")
    parser.add_argument("--activations", default=None,
                        help="the engine's activation path (one its build allowed; default: the fastest here)")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    # opened as engine-run opens it (runtime.launcher: what lives as long as the engine leaves the cyclic collector)
    options = EngineOptions(kv_cache_gib=1.0, max_num_tokens=args.max_num_tokens, prefill_chunk=args.prefill_chunk or None,
                            activations=args.activations)
    with open_llm_engine(args.engine, options) as llm:
        weights = weight_bytes(args.engine)
        run_level(llm, 1, 1, 8, 4, weights, seed=99)  # warm up caches and threads
        kiln = [run_level(llm, n, n, args.prompt_len, args.output_len, weights, seed=n) for n in (1, args.requests)]
        choice = llm.engine.activation_choice
        path = choice.activations if choice is not None else llm.engine.manifest.activations
        print(f"engine {args.engine}  activations {path}  threads {torch.get_num_threads()}  prompt {args.prompt_len}  "
              f"output {args.output_len}  max_num_tokens {llm.limits.max_num_tokens}  "
              f"prefill_chunk {args.prefill_chunk or 'none'}")
        print(table(kiln))
        source, vocab = llm.engine.manifest.model_source, llm.engine.manifest.vocab_size
    if not args.transformers:
        return
    from builder.verify import load_transformers_model

    model = load_transformers_model(source)
    for ours in kiln:
        theirs = run_transformers(model, synthetic_prompts(ours.requests, args.prompt_len, vocab, seed=ours.requests),
                                  args.output_len)
        print(f"transformers, {ours.requests} request(s): {theirs['output_tok_s']:.1f} output tok/s, "
              f"TTFT {theirs['ttft_ms']:.1f} ms, ITL {theirs['itl_ms']:.1f} ms; "
              f"kiln / transformers output tokens/s: {ours.output_tok_s / theirs['output_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
