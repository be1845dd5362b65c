"""The planner's estimates beside what `engine-run bench` measures, for built cpu engines.

    python benchmarks/calibrate_planner.py ENGINE [ENGINE ...] [--prompt-len 128] [--output-len 128]

For each engine, the plan in its manifest is priced by `engine-build plan`'s code (builder/planning/planner.py:
the model's shape and stored bytes, the cpu device of plans/devices.toml with its efficiencies) and
the engine is benchmarked at concurrency 1 and 8 with the same prompt and answer lengths. Three
figures are compared, each as measured / predicted:

- decode tok/s at batch 1: 1 / ITL p50 at concurrency 1, against one decode step of one sequence;
- prefill tok/s: the bench's prompt tokens over the time of the steps that carried them, against one
  step of the whole prompt;
- decode tok/s at batch 8: 8 / ITL p50 at concurrency 8, against the planner's serving step, which
  carries each sequence's prompt tokens along with its answer's (8 x (1 + prompt / answer) tokens:
  what the bench's steps hold, its `tok/step` column).

The cpu device's efficiencies were fitted to the first two figures of the default engine; the others
check them. A ratio within 0.7-1.3 is the planner's accuracy goal on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.planning.plan import load_devices, plan_from_dict  # noqa: E402
from builder.planning.planner import Candidate, Workload, price
from builder.planning.shapes import load_shape  # noqa: E402


def predicted(engine: Path, prompt: int, output: int) -> dict:
    manifest = json.loads((engine / "manifest.json").read_text())
    plan = plan_from_dict(manifest["plan"], str(engine))
    model = manifest["model"]
    shape = load_shape(model["source"]) if model["source"].endswith(".gguf") else load_shape(model["name"])
    c = Candidate(plan.device, plan.tp, plan.pp, plan.quant.method, plan.kv_cache.dtype, plan)
    price(shape, c, load_devices()[plan.device], Workload(prompt, output), [1, 8])
    if not c.fits:
        raise SystemExit(f"{engine}: the planner says its plan does not fit: {c.problem}")
    return {"decode_1": c.tokens_per_s(1), "prefill": prompt / c.prefill_s, "decode_8": 8 / c.serving[8]}


def measured(engine: Path, prompt: int, output: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(["engine-run", "bench", str(engine), "-c", "1", "-c", "8", "--requests", "8",
                        "--prompt-len", str(prompt), "--output-len", str(output), "--no-roofline",
                        "--json", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        levels = {level["concurrency"]: level for level in json.loads(out.read_text())["levels"]}
    return {"decode_1": 1e3 / levels[1]["itl_p50_ms"], "prefill": levels[1]["prefill_tok_s"],
            "decode_8": 8e3 / levels[8]["itl_p50_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="+", type=Path)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; prompts {args.prompt_len}, answers {args.output_len} tokens")
    print(f"{'engine':28s} {'figure':16s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}")
    for engine in args.engines:
        guess = predicted(engine, args.prompt_len, args.output_len)
        seen = measured(engine, args.prompt_len, args.output_len)
        for key, title in (("decode_1", "decode tok/s b=1"), ("prefill", "prefill tok/s"),
                           ("decode_8", "decode tok/s b=8")):
            print(f"{engine.name:28s} {title:16s} {guess[key]:10.1f} {seen[key]:10.1f} {seen[key] / guess[key]:6.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
