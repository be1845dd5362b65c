"""How long builds take and how much memory they hold: wall time and peak RSS of `engine-build build` runs, each
in its own process, beside the build's own price (builder/planning/build_budget.py) and its accuracy figures.

    python benchmarks/bench_builds.py [--work DIR] [--only NAME,...] [--cached] [--json FILE]

Builds (NAME):
  smollm2-default, smollm2-int8, smollm2-int4-awq   the embedded SmolLM2-135M, cpu plans
  smollm2-tensorrt                                  SmolLM2 for plans/a100-tp2-int4.toml (needs the tensorrt extra)
  1b-int4, 1b-fp8, 1b-int4-awq                      a random Llama-3.2-1B-shaped checkpoint (2.5 GB bf16)
  8b-tp8-rank3                                      rank 3 of a tp=8 int4 plan of a random Llama-3.1-8B-shaped
                                                    checkpoint (16 GB bf16), built alone with --rank

The random checkpoints are written under --work the first time (the 8B one shard by shard, never whole in memory)
and reused. Each build starts with an empty Kiln cache (the reference's greedy answers decoded, as on a fresh CI
runner) unless --cached. Figures are of one run on whatever else the machine is doing: say the load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})


def build_specs(work: Path) -> dict[str, list[str]]:
    one_b, eight_b = str(work / "llama-1b-random"), str(work / "llama-8b-random")
    return {
        "smollm2-default": [],
        "smollm2-int8": ["--quant", "int8"],
        "smollm2-int4-awq": ["--quant", "int4-awq"],
        "smollm2-tensorrt": ["--plan", str(ROOT / "plans" / "a100-tp2-int4.toml")],
        "1b-int4": ["--model", one_b, "--quant", "int4"],
        "1b-fp8": ["--model", one_b, "--quant", "fp8"],
        "1b-int4-awq": ["--model", one_b, "--quant", "int4-awq"],
        "8b-tp8-rank3": ["--model", eight_b, "--quant", "int4", "--tp", "8", "--rank", "3"],
    }


def llama_1b(path: Path) -> None:
    """A seeded random Llama-3.2-1B-shaped checkpoint, made in bf16 by transformers."""
    import torch
    from gpu_check_models import write_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    write_tokenizer(path, None)


def llama_8b(path: Path) -> None:
    """A random Llama-3.1-8B-shaped checkpoint written a layer at a time (N(0, 0.02) bf16 weights, norms of 1), as
    sharded safetensors with an index: never the whole model in memory."""
    import torch
    from gpu_check_models import LLAMA_8B, write_tokenizer
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    c = LLAMA_8B
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    index, total = {}, 0

    def write(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        index.update({t: name for t in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    write("model-embed.safetensors", {"model.embed_tokens.weight": weight(c["vocab_size"], h)})
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        write(f"model-layer{i:02d}.safetensors", {
            p + "self_attn.q_proj.weight": weight(q, h), p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.weight": weight(kv, h), p + "self_attn.o_proj.weight": weight(h, q),
            p + "mlp.gate_proj.weight": weight(inter, h), p + "mlp.up_proj.weight": weight(inter, h),
            p + "mlp.down_proj.weight": weight(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    write("model-head.safetensors", {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                     "lm_head.weight": weight(c["vocab_size"], h)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": index}, indent=1))
    config = dict(LLAMA_8B, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path, None)


def ensure_checkpoints(work: Path, names: list[str]) -> None:
    for prefix, folder, make in (("1b", "llama-1b-random", llama_1b), ("8b", "llama-8b-random", llama_8b)):
        path = work / folder
        if any(n.startswith(prefix) for n in names) and not (path / "tokenizer.json").is_file():
            started = time.perf_counter()
            print(f"writing {path} ...", flush=True)
            make(path)
            print(f"  {time.perf_counter() - started:.0f} s", flush=True)


def run_build(name: str, args: list[str], out: Path, cache: str) -> dict:
    """One build in its own process: wall seconds, peak RSS (its rusage), what it printed, its manifest's figures."""
    env = dict(os.environ, KILN_CACHE_DIR=cache)
    shutil.rmtree(out, ignore_errors=True)  # built, not found up to date
    command = [sys.executable, "-m", "builder.cli", "build", *args, "--out", str(out), "--force", "--no-progress"]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - started
    row = {"build": name, "seconds": round(seconds, 1), "exit": proc.returncode,
           "load_average": round(os.getloadavg()[0], 2)}
    printed = [line for line in proc.stdout.splitlines() if line.startswith(("built", "up to date"))]
    row["printed"] = printed[0] if printed else (proc.stderr.strip().splitlines() or ["(nothing)"])[-1]
    # the build's own figures (its /proc VmHWM: a child's rusage would count this process's memory before exec)
    peak = re.search(r"peak memory ([0-9.]+) GiB(?:, priced ([0-9.]+) GiB)?", row["printed"])
    if peak:
        row["peak_rss_gib"], row["priced_gib"] = float(peak.group(1)), peak.group(2) and float(peak.group(2))
    took = re.search(r"[0-9]+ s, priced (about [0-9.]+ (?:s|min|h))", row["printed"])
    row["priced_time"] = took.group(1) if took else None
    manifest = out / "manifest.json"
    if row["exit"] == 0 and manifest.is_file():
        figures = json.loads(manifest.read_text()).get("accuracy") or {}
        for key in ("ppl_reference", "ppl_quantized", "kl_mean", "greedy_agreement_pct", "greedy_mean_leading"):
            if key in figures:
                row[key] = figures[key]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="engines/bench_builds", help="checkpoints and engines (reused)")
    parser.add_argument("--only", help="a comma-separated subset of the builds above")
    parser.add_argument("--cached", action="store_true", help="keep one Kiln cache across the builds")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    specs = build_specs(work)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        parser.error(f"--only: unknown build(s) {', '.join(unknown)}; choose from {', '.join(specs)}")
    ensure_checkpoints(work, names)
    shared = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    rows = []
    for name in names:
        cache = shared if args.cached else tempfile.mkdtemp(prefix="kiln-bench-cache-")
        row = run_build(name, specs[name], work / "engines" / name, cache)
        rows.append(row)
        print(f"{name}: {row['seconds']} s, peak RSS {row.get('peak_rss_gib')} GiB, load {row['load_average']}: "
              f"{row['printed']}", flush=True)
    columns = ["build", "seconds", "priced_time", "peak_rss_gib", "priced_gib", "ppl_reference", "ppl_quantized", "kl_mean",
               "greedy_agreement_pct", "greedy_mean_leading", "load_average"]
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    sys.exit(1 if any(r["exit"] for r in rows) else 0)


if __name__ == "__main__":
    main()
