"""Speculative decoding side by side: one engine, each request run with and without speculation.

    python benchmarks/bench_speculative.py [ENGINE] [--rounds 3] [--max-tokens 192] [--json out.json]

Batch 1: every prompt of benchmarks/speculative_prompts.py (input-grounded tasks, verbatim copies
and open-ended chat, in the chat template), greedy, run with speculation off and on in alternating order, `rounds`
times; decode speed is (output tokens - 1) / (time of the last token - time of the first), so
prefill is left out. Then closed loops of 8 and 32 concurrent requests over the same prompts, off
and on alternately: output tokens/s over the whole run. Per mode: acceptance (guesses that stood /
guesses verified) and tokens per step of a speculating sequence. Greedy answers are compared
token for token between the two modes. One process and one engine (speculation is a per-request
switch), so both modes share the machine's state; timings on a shared host vary ±25% minutes apart,
which the alternation spreads over both modes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from speculative_prompts import CHAT, GROUNDED, VERBATIM  # noqa: E402

from runtime.core.engine import EngineOptions, LLMEngine  # noqa: E402
from runtime.core.sampling import SamplingParams  # noqa: E402
from runtime.core.speculative import SpeculativeConfig  # noqa: E402


def run(llm: LLMEngine, prompts: list[str], concurrency: int, requests: int, max_tokens: int, speculative: bool):
    """Closed loop of `concurrency` requests in flight over `prompts` (cycled) until `requests` finish."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative=speculative)
    queue = [prompts[i % len(prompts)] for i in range(requests)]
    first, last, steps, outputs = {}, {}, {}, {}
    stats0 = llm.stats()
    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        llm.add_request(queue.pop(0), params)
    while llm.has_unfinished():
        for out in llm.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            steps[out.request_id] = steps.get(out.request_id, 0) + 1
            if out.finished:
                outputs[out.request_id] = out
                if queue:
                    llm.add_request(queue.pop(0), params)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    tokens = sum(len(o.token_ids) for o in outputs.values())
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs.values())
    decode_time = sum(last[r] - first[r] for r in outputs)
    return {
        "output_tok_s": tokens / elapsed, "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
        "proposed": stats.spec_proposed_tokens - stats0.spec_proposed_tokens,
        "accepted": stats.spec_accepted_tokens - stats0.spec_accepted_tokens,
        "decode_tokens": decode_tokens, "decode_steps": sum(steps[r] - 1 for r in outputs),
        "outputs": [outputs[r].token_ids for r in sorted(outputs, key=lambda r: int(r.split("-")[-1]))],
    }


def summary(results: list[dict], speed: str) -> dict:
    """Mean speed over runs; acceptance and tokens per step of a sequence over all of their steps."""
    proposed = sum(x["proposed"] for x in results)
    return {"decode_tok_s": sum(x[speed] for x in results) / len(results),
            "acceptance_pct": 100 * sum(x["accepted"] for x in results) / proposed if proposed else 0.0,
            "tokens_per_step": sum(x["decode_tokens"] for x in results) / max(1, sum(x["decode_steps"] for x in results))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", nargs="?", default="engines/smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--concurrency", type=int, action="append", default=None)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLMEngine.from_dir(args.engine, EngineOptions(speculative=SpeculativeConfig(max_k=args.max_k)))
    chat = lambda q: llm.apply_chat_template([{"role": "user", "content": q}])  # noqa: E731
    sets = {"input-grounded": [chat(q) for q in GROUNDED], "verbatim copy": [chat(q) for q in VERBATIM],
            "open-ended chat": [chat(q) for q in CHAT]}
    run(llm, sets["open-ended chat"][:1], 1, 1, 16, True)  # warm up: threads, tapes
    report = {"engine": args.engine, "rounds": args.rounds, "max_tokens": args.max_tokens, "batch1": {}, "batched": {}}
    rows = []
    for name, prompts in sets.items():
        acc = {False: [], True: []}
        same = total = 0
        for r in range(args.rounds):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                results = [run(llm, [p], 1, 1, args.max_tokens, spec) for p in prompts]
                acc[spec].append(results)
                print(f"  batch 1, {name}, round {r + 1}, speculation {'on' if spec else 'off'}: "
                      f"{sum(x['decode_tok_s'] for x in results) / len(results):.1f} tok/s", file=sys.stderr)
            for off, on in zip(acc[False][-1], acc[True][-1]):
                same += off["outputs"] == on["outputs"]
                total += 1
        entry = {"on" if spec else "off": summary([x for results in acc[spec] for x in results], "decode_tok_s")
                 for spec in (False, True)}
        entry["speedup"] = entry["on"]["decode_tok_s"] / entry["off"]["decode_tok_s"]
        entry["identical_greedy"] = f"{same}/{total}"
        report["batch1"][name] = entry
        rows.append((f"batch 1, {name}", entry))
    mixed = sets["input-grounded"] + sets["open-ended chat"]
    for level in args.concurrency or [8, 32]:
        results = {False: [], True: []}
        for r in range(max(1, args.rounds - 1)):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                res = run(llm, mixed, level, 2 * level, 128, spec)
                results[spec].append(res)
                print(f"  {level} concurrent, speculation {'on' if spec else 'off'}: {res['output_tok_s']:.1f} tok/s",
                      file=sys.stderr)
        entry = {"on" if spec else "off": summary(results[spec], "output_tok_s") for spec in (False, True)}
        entry["speedup"] = entry["on"]["decode_tok_s"] / entry["off"]["decode_tok_s"]
        report["batched"][str(level)] = entry
        rows.append((f"{level} concurrent (output tok/s)", entry))
    print(f"{'workload':<34} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} {'accept %':>9} {'tok/step':>9} {'same greedy':>12}")
    for label, e in rows:
        print(f"{label:<34} {e['off']['decode_tok_s']:>10.1f} {e['on']['decode_tok_s']:>9.1f} {e['speedup']:>6.2f} "
              f"{e['on']['acceptance_pct']:>9.0f} {e['on']['tokens_per_step']:>9.2f} {e.get('identical_greedy', ''):>12}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
