"""engine-build verify: an engine's logits against a reference. A cpu or cuda engine's (reference interpreter, or
the engine's own kernels) against Hugging Face transformers; a tensorrt engine's ONNX under ONNX Runtime against
the cpu engine of the same quantized program, rebuilt from the model, as its build verified it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from builder.errors import KilnError
from builder.graph.interpret import Interpreter
from builder.graph.ir import Graph
from builder.graph.trace import trace
from builder.pipeline import build_pipeline, run_pipeline
from builder.planning.plan import plan_from_dict
from builder.quant import methods
from builder.sources import load_model
from builder.sources.lazy_tensors import LazyTensors
from builder.targets import target
from builder.targets.tensorrt.verify_onnx import Verification, cpu_reference, verify_ranks
from passes.context import PassContext
from runtime.backends.activations import INTEGER_ACTIVATIONS
from runtime.backends.step import StepMetadata
from runtime.format.engine_format import EngineError, Manifest, map_rank_file
from runtime.format.special_tokens import from_tokenizer

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
)


# Without --tolerance, an engine on integer activations passes when its top-1 token is the reference's on
# every prompt and its logits are within this share of the largest reference logit.
# The cuda target's f16 and bf16 activations round every op's output the same way (10 and 7 fraction bits).
INTEGER_ACTIVATION_TOLERANCE = {"int16": 0.01, "int12": 0.02, "int8": 0.05, "f16": 0.02, "bf16": 0.05}


@dataclass
class VerifyReport:
    max_abs_diff: float = 0.0
    max_reference: float = 0.0      # largest |logit| of the reference
    top1_same: bool = True          # on every prompt
    activations: str = "f32"  # "int8" / "int16" / "int12": the engine computes some layers on such activations (approximate)
    lines: list[str] = field(default_factory=list)


def load_transformers_model(source: str):
    """The reference model: transformers loading the same HF directory or GGUF file, float32."""
    from transformers import AutoModelForCausalLM

    path = Path(source)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def load_tokenizer(engine: Path, manifest: Manifest):
    """(tokenizer, the special tokens around a raw prompt) of the engine, as engine-run reads them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(engine / "tokenizer.json"))
    config = json.loads((engine / "tokenizer_config.json").read_text(encoding="utf-8"))
    return tokenizer, manifest.special_tokens or from_tokenizer(config, tokenizer)


@torch.inference_mode()
def verify_engine(engine: Path, model_source: str | None, prompts: list[str] | None) -> VerifyReport:
    try:
        manifest = Manifest.read(engine)
        if manifest.world_size != 1:
            raise KilnError("verify: the reference interpreter runs single-rank engines; this one has "
                            f"{manifest.world_size} ranks (run `engine-run generate` to check it)")
        program, tensors = map_rank_file(engine / manifest.ranks[0].file)
    except EngineError as exc:
        raise KilnError(str(exc)) from None
    own = getattr(target(manifest.target), "verify_logits", None)
    if own is not None:  # the engine's own kernels, not the reference interpreter
        lines, logits = own(engine, manifest)
        report = VerifyReport(activations=manifest.activations, lines=lines)
    else:
        interpreter = Interpreter(program, tensors)
        modes = {n["attrs"].get("act", "f32") for n in json.loads(program)["nodes"]}
        report = VerifyReport(activations=next((m for m in INTEGER_ACTIVATIONS if m in modes), "f32"))
        logits = lambda ids: interpreter.logits(ids)[-1]  # noqa: E731
    reference, line = reference_logits(engine, model_source or manifest.model_source)
    report.lines.append(line)
    tokenizer, special = load_tokenizer(engine, manifest)
    for text in prompts or DEFAULT_PROMPTS:
        ids = special.apply(tokenizer.encode(text, add_special_tokens=False).ids)
        ours = logits(ids)
        theirs = reference(ids)
        diff = (ours - theirs).abs().max().item()
        same_top = int(ours.argmax()) == int(theirs.argmax())
        report.max_abs_diff = max(report.max_abs_diff, diff)
        report.max_reference = max(report.max_reference, theirs.abs().max().item())
        report.top1_same &= same_top
        report.lines.append(f"{len(ids):4d} tokens  max|Δ| {diff:.3g}  top-1 {'same' if same_top else 'DIFFERS'}  {text!r}")
    return report


def reference_logits(engine: Path, model_source: str) -> tuple[Callable[[list[int]], torch.Tensor], str]:
    """ids -> the last position's reference logits, and a line naming the reference. An engine whose plan keeps
    the source's weights is compared with transformers on the model; one whose weights the build rounded itself
    (int8, int4, fp8: their cost against the float model is what the build measured, in its manifest) with its
    own quantized program, rebuilt from the model and run in f32 by the cpu target's kernels."""
    doc = json.loads((engine / "manifest.json").read_text(encoding="utf-8"))
    quant = doc["plan"]["quant"]
    if not methods.method(quant["method"]).requantizes:
        model = load_transformers_model(model_source)
        return (lambda ids: model(torch.tensor([ids])).logits[0, -1].float()), "reference: transformers, f32"

    executor = cpu_reference(quantized_program(model_source, doc), "f32", "f32", doc["plan"]["kv_cache"]["block_size"])
    measured = doc.get("accuracy") or {}
    cost = (f"; against the float model the build measured perplexity {measured['ppl_increase_pct']:+.2f}%, greedy "
            f"agreement {measured['greedy_agreement_pct']:.1f}%" if "ppl_increase_pct" in measured
            and "greedy_agreement_pct" in measured else "")
    return (lambda ids: executor_logits(executor, ids)), (
        f"reference: the engine's quantized program ({quant['method']} weights as the build rounded them) in f32 on "
        f"this CPU{cost}")


def executor_logits(executor, ids: list[int]) -> torch.Tensor:
    """The last position's logits of one prefill of ids through an executor (blocks 0, 1, ... of its pool)."""
    n = len(ids)
    blocks = -(-n // executor.cache.block_size)
    if blocks > executor.cache.num_blocks:
        raise KilnError(f"verify: a prompt of {n} tokens is longer than the {executor.cache.num_blocks} KV blocks of "
                        f"{executor.cache.block_size} tokens verify keeps; give a shorter --prompt")
    meta = StepMetadata(torch.tensor(ids), torch.arange(n), torch.arange(n),
                        torch.arange(blocks, dtype=torch.int32).unsqueeze(0), torch.tensor([n], dtype=torch.int32),
                        torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]))
    return executor.execute(meta)[0].float().clone()


def verify_onnx(engine: Path, manifest: Manifest,
                model_source: str | None) -> tuple[Verification | None, str | None]:
    """A tensorrt engine's ONNX, every rank under ONNX Runtime stitched in one process, against the cpu engine of
    the quantized program it was lowered from, on the build's steps (builder/targets/tensorrt/verify_onnx.py).
    Returns (the Verification, None), or (None, why nothing can run here) for an engine without ONNX or with bf16
    activations."""
    missing = [r.rank for r in manifest.ranks if not r.onnx_dir]
    if missing:
        return None, f"the manifest lists no ONNX for rank(s) {', '.join(map(str, missing))}"
    if manifest.activations == "bf16":
        return None, "ONNX Runtime has no bf16 kernels on the CPU (the build checked and linted the ONNX, not ran it)"
    doc = json.loads((engine / "manifest.json").read_text())
    whole = quantized_program(model_source or manifest.model_source, doc)
    reference = cpu_reference(whole, manifest.activations, manifest.kv_dtype, manifest.block_size)
    try:
        return verify_ranks(reference, [engine / r.onnx_dir for r in manifest.ranks], manifest.group, manifest.pp,
                            manifest.vocab_size, manifest.block_size), None
    except EngineError as exc:
        raise KilnError(f"verify: {exc}") from None


def quantized_program(model_source: str, doc: dict) -> Graph:
    """The whole program before sharding that the engine of manifest `doc` was built from: the model traced again
    and run through the manifest's passes up to sharding (a KilnError when the model or the passes differ)."""
    model = load_model(model_source)
    if model.weights_sha256() != doc["model"]["weights_sha256"]:
        raise KilnError(f"verify: {model_source} is not the model this engine was built from (its weights' sha256 "
                        "differs from the manifest's); the ONNX is compared with that model's quantized program: "
                        "--model names where it is")
    plan = plan_from_dict(doc["plan"], "in the manifest")
    try:
        calibration = Path(plan.quant.calib).read_text(encoding="utf-8") if plan.quant.calib else None
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"verify: [quant] calib {plan.quant.calib}: the build calibrated on this text, which cannot "
                        f"be read ({exc})") from None
    pipeline = build_pipeline(plan, calibration)
    first = next(i for i, step in enumerate(pipeline) if step.per_rank)  # the passes before sharding
    if [step.record() for step in pipeline[:first]] != doc["passes"][:first]:
        raise KilnError("verify: this Kiln's passes for the engine's plan are not the ones that built it (another "
                        "version, or another calibration text), so its quantized program cannot be rebuilt; "
                        "rebuild the engine")
    passes = [step for step in pipeline[:first] if step.name != "measure_accuracy"]  # it only measures, and gates
    graph = trace(model)
    graph.tensors = LazyTensors({name: functools.partial(model.load, name) for name in graph.weights})
    [whole] = run_pipeline(graph, PassContext(plan=plan, model=model, calibration_text=calibration), passes)
    return whole
