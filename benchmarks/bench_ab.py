"""Two engines side by side in one process: batch-1 prefill and decode tokens/s, interleaved rounds.

    python benchmarks/bench_ab.py ENGINE_A ENGINE_B [--rounds 5] [--prompt-len 128] [--decode-len 32]

Each round runs A then B (the order alternates from round to round): one request of --prompt-len
synthetic tokens, whose first step (the whole prompt) is timed as prefill, then --decode-len greedy
tokens timed step by step as decode. Prints each engine's median and range over the rounds and
B's median as a share of A's. Interleaving makes a noisy machine's drift hit both engines alike;
compare ratios, not absolute figures, across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import runtime  # noqa: F401  (OpenMP settings before torch)
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams


def one_round(llm: LLMEngine, prompt_len: int, decode_len: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one request."""
    prompt = [(7 * i + 11) % 1000 + 10 for i in range(prompt_len)]
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode_len + 1, ignore_eos=True))
    start = time.perf_counter()
    llm.step()  # the whole prompt, and the first token
    prefill = prompt_len / (time.perf_counter() - start)
    start, steps = time.perf_counter(), 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    return prefill, steps / (time.perf_counter() - start)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):.1f} .. {max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs=2, type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=32)
    args = parser.parse_args()
    options = EngineOptions(kv_cache_gib=0.25, enable_prefix_caching=False)
    engines = [LLMEngine.from_dir(path, options) for path in args.engines]
    for llm in engines:  # warm-up: page the weights in, record the step tapes
        one_round(llm, args.prompt_len, 4)
    figures = [{"prefill": [], "decode": []} for _ in engines]
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            prefill, decode = one_round(engines[i], args.prompt_len, args.decode_len)
            figures[i]["prefill"].append(prefill)
            figures[i]["decode"].append(decode)
    print(f"{args.rounds} interleaved rounds, prompt {args.prompt_len} tokens, decode {args.decode_len} tokens, "
          "batch 1; tokens/s median [range]")
    for kind in ("prefill", "decode"):
        a, b = (statistics.median(f[kind]) for f in figures)
        for name, f in zip("AB", figures):
            print(f"  {kind:7s} {name} {summary(f[kind])}  {args.engines['AB'.index(name)]}")
        print(f"  {kind:7s} B / A = {b / a:.2f}")


if __name__ == "__main__":
    main()
