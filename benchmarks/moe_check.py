"""Mixtures of experts on the cuda backend (a GPU) or the cpu target: agreement with the cpu engine, and decode
speed against the dense model with the same active parameters.

    python benchmarks/moe_check.py [--out moe_check] [--work engines/moe_check_work] [--cpu] [--interpret]
        [--sections agreement,speed] [--methods none,int4]

1. agreement (GPU, or --interpret): small random Mixtral and Qwen2-MoE checkpoints (with a shared expert) built
   for the cuda target (f32 activations and KV) and for the cpu target; greedy tokens of 8 random prompts, 24
   tokens each, compared.
2. speed: a random Mixtral-shaped MoE (8 experts, top-2, hidden 1024, expert MLP 2816, 8 layers, vocab 32000)
   against a dense Llama whose MLP is as wide as two experts (5632): the same active parameters a token. On a GPU:
   bf16 cuda engines, decode at batch 1/8/64 after 128-token prompts and a 512-token prefill (gpu_check's method);
   with --cpu: f32 cpu engines, batch-1 decode, on the host's threads.
Random weights: what is measured is speed and agreement, never answer quality. Results: OUT/moe_check.json and
.md; progress lines carry the elapsed seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from gpu_check import Check, log, table  # noqa: E402
from gpu_check_models import write_tokenizer  # noqa: E402

ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.02)
SMALL = dict(ATTENTION, vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32)
MODELS = {  # name -> (transformers classes, config)
    "mixtral-small": ("Mixtral", dict(SMALL, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2moe-small": ("Qwen2Moe", dict(SMALL, intermediate_size=512, moe_intermediate_size=256,
                                        shared_expert_intermediate_size=512, num_experts=8, num_experts_per_tok=2)),
    "moe-8x2816": ("Mixtral", dict(ATTENTION, vocab_size=32000, hidden_size=1024, num_hidden_layers=8,
                                   intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2)),
    "dense-5632": ("Llama", dict(ATTENTION, vocab_size=32000, hidden_size=1024, num_hidden_layers=8,
                                 intermediate_size=5632)),
}


def random_model(path: Path, family: str, config: dict) -> Path:
    """A seeded random checkpoint of transformers' `family` saved at path (reused when complete)."""
    import transformers

    if (path / "tokenizer.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, config["vocab_size"])
    return path


class MoeCheck(Check):
    def model(self, name: str) -> str:
        family, config = MODELS[name]
        return str(random_model(self.work / name, family, config))

    def section_agreement(self) -> dict:
        from runtime.core.sampling import SamplingParams

        rows = []
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (5, 17, 40, 9, 64, 3, 23, 12)]
        params = SamplingParams(temperature=0.0, max_tokens=24 if not self.interpret else 6, ignore_eos=True)
        for name, method in (("mixtral-small", "none"), ("qwen2moe-small", "none"), ("mixtral-small", "int4"),
                             ("qwen2moe-small", "fp8")):
            answers = {}
            cpu = self.cpu_plan().with_overrides("quant", method=method, group_size=128)
            for kind, plan in (("cpu", cpu), ("cuda", self.cuda_plan("f32", "f32", method))):
                llm = self.engine(self.build(f"{name}-{method}-{kind}", self.model(name), plan), kv_gib=1)
                answers[kind] = [o.token_ids for o in llm.generate(prompts, params)]
                del llm
                self.free()
            same = sum(a == b for a, b in zip(answers["cpu"], answers["cuda"]))
            rows.append({"model": name, "experts": method, "identical answers": f"{same}/{len(prompts)}"})
            log(f"{name} ({method} experts): cuda f32 vs cpu f32: {same}/{len(prompts)} identical greedy answers")
        return {"rows": rows, "markdown": table("Greedy answers, cuda (f32) against cpu (f32), the same weights", rows,
                                                ["model", "experts", "identical answers"])}

    def section_speed(self) -> dict:
        from runtime.measure.bench import StepReads

        rows = []
        runs = [("none", "f32")] if self.args.cpu else [(m, "bf16") for m in self.args.methods.split(",")]
        for method, act in runs:
            for name in ("moe-8x2816", "dense-5632"):
                label = f"{name} {method}"
                if self.args.cpu:
                    plan = self.cpu_plan()
                    path = self.build(f"{name}-cpu", self.model(name), plan)
                    measured = self.throughput(path, label, (1, 8), (), 16)
                else:
                    path = self.build(f"{name}-{method}-{act}", self.model(name), self.cuda_plan(act, act, method))
                    measured = self.throughput(path, label, (1, 8, 64), (512,), 32)
                reads = StepReads(path)
                for r in measured:  # the bytes a step reads: only the experts its tokens chose (uniform routing)
                    read = reads.per_step(1, int(r["mode"].split()[-1]))
                    r["read GB/step"] = read / 1e9
                    r["GB/s"] = read / (r["step ms"] / 1e3) / 1e9
                rows += measured
        where = "cpu f32" if self.args.cpu else "cuda, bf16 activations"
        return {"rows": rows, "markdown": table(f"MoE against dense with the same active parameters ({where})", rows,
                                                ["engine", "mode", "tok/s", "step ms", "weight GB/step",
                                                 "read GB/step", "GB/s"])}

    def run_all(self) -> int:
        failed = 0
        sections = [("speed", self.section_speed)] if self.args.cpu else [("agreement", self.section_agreement),
                                                                          ("speed", self.section_speed)]
        if self.interpret:
            sections = sections[:1]
        sections = [(name, fn) for name, fn in sections if name in self.args.sections.split(",")]
        for name, fn in sections:
            started = time.perf_counter()
            try:
                self.report["sections"][name] = fn()
            except Exception:  # noqa: BLE001 - a failed section is reported, the others still run
                failed = 1
                self.report["sections"][name] = {"error": traceback.format_exc()}
                log(f"section {name} FAILED:\n{traceback.format_exc()}")
            log(f"section {name}: {time.perf_counter() - started:.0f} s")
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "moe_check.json").write_text(json.dumps(self.report, indent=1, default=str))
            (self.out / "moe_check.md").write_text("\n\n".join(s.get("markdown", f"```\n{s.get('error')}\n```")
                                                              for s in self.report["sections"].values()) + "\n")
        return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="moe_check")
    parser.add_argument("--work", default="engines/moe_check_work")
    parser.add_argument("--cpu", action="store_true", help="section 2 on the cpu target (no GPU needed)")
    parser.add_argument("--interpret", action="store_true", help="section 1 in Triton's interpreter (tiny prompts)")
    parser.add_argument("--sections", default="agreement,speed", help="a subset of agreement,speed")
    parser.add_argument("--methods", default="none,int4", help="the expert formats section 2 times on a GPU")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interpret:
        import os

        os.environ["KILN_CUDA_INTERPRET"] = "1"
    interpret = args.interpret
    args.interpret = interpret or args.cpu  # Check's set-up then asks for no GPU
    check = MoeCheck(args)
    check.interpret = interpret
    sys.exit(check.run_all())


if __name__ == "__main__":
    main()
