"""Accuracy of every quantization plan on one model, as one table: builds each and reads its manifest.

    python benchmarks/fidelity_table.py [--model smollm2-135m] [--out /tmp/kiln-fidelity]
        [--plans source,int8,int4,int4-awq,fp8] [--activations f32]

Each plan is the default plan with `[quant] method` (and --activations) changed; the builds are
kept under --out (an engine already built there is reused). Prints a Markdown table of the
figures every lossy build records: perplexity change, mean KL, and greedy chat agreement (the
share of shipped chat prompts whose first 32 greedy tokens equal the unquantized model's, and the
mean identical leading tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from builder.build import build_engine
from builder.planning.plan import load_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-fidelity"))
    parser.add_argument("--plans", default="source,int8,int4,int4-awq,fp8")
    parser.add_argument("--activations", default="f32")
    args = parser.parse_args()
    rows = []
    for method in args.plans.split(","):
        plan = load_plan().with_overrides("quant", method=method, activations=args.activations)
        out = args.out / f"{method}-{args.activations}"
        start = time.perf_counter()
        result = build_engine(args.model, plan, out, force=True, show_progress=False)
        seconds = time.perf_counter() - start
        a = result.manifest["accuracy"]
        agreed = round(a["greedy_agreement_pct"] * a["greedy_prompts"] / 100)
        rows.append(f"| {method} | {args.activations} | {plan.kv_cache.dtype} | {a['ppl_increase_pct']:+.3f} % | "
                    f"{a['kl_mean']:.2e} | {agreed} / {a['greedy_prompts']} ({a['greedy_agreement_pct']:.1f} %) | "
                    f"{a['greedy_mean_leading']:.1f} | {seconds:.0f} s |")
        print(rows[-1], flush=True)
    print(f"\n{args.model}\n\n| weights | activations | KV cache | perplexity | mean KL (nats) | "
          "greedy answers identical | identical leading tokens | build |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps({"model": args.model, "plans": args.plans, "activations": args.activations}))


if __name__ == "__main__":
    main()
