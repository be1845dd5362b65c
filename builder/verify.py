"""engine-build verify: an engine's logits (reference interpreter) against Hugging Face transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from builder.errors import KilnError
from builder.interpret import Interpreter
from builder.packing import INTEGER_ACTIVATIONS
from runtime.engine_format import EngineError, Manifest, map_rank_file
from runtime.special_tokens import from_tokenizer

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
)


# Without --tolerance, an engine on integer activations passes when its top-1 token is the reference's on
# every prompt and its logits are within this share of the largest reference logit.
# The cuda target's f16 and bf16 activations round every op's output the same way (10 and 7 fraction bits).
INTEGER_ACTIVATION_TOLERANCE = {"int16": 0.01, "int8": 0.05, "f16": 0.02, "bf16": 0.05}


@dataclass
class VerifyReport:
    max_abs_diff: float = 0.0
    max_reference: float = 0.0      # largest |logit| of the reference
    top1_same: bool = True          # on every prompt
    activations: str = "f32"  # "int8" / "int16": the engine computes some layers on such activations (approximate)
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
    if manifest.target == "cuda":  # the engine's own kernels, not the reference interpreter
        from builder.targets.cuda.verify import cuda_logits, kernel_coverage

        report = VerifyReport(activations=manifest.activations, lines=[kernel_coverage(engine, manifest)])
        logits, where = cuda_logits(engine, manifest)
        report.lines.append(f"logits computed by the cuda backend {where}")
    else:
        interpreter = Interpreter(program, tensors)
        modes = {n["attrs"].get("act", "f32") for n in json.loads(program)["nodes"]}
        report = VerifyReport(activations=next((m for m in INTEGER_ACTIVATIONS if m in modes), "f32"))
        logits = lambda ids: interpreter.logits(ids)[-1]  # noqa: E731
    reference = load_transformers_model(model_source or manifest.model_source)
    tokenizer, special = load_tokenizer(engine, manifest)
    for text in prompts or DEFAULT_PROMPTS:
        ids = special.apply(tokenizer.encode(text, add_special_tokens=False).ids)
        ours = logits(ids)
        theirs = reference(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours - theirs).abs().max().item()
        same_top = int(ours.argmax()) == int(theirs.argmax())
        report.max_abs_diff = max(report.max_abs_diff, diff)
        report.max_reference = max(report.max_reference, theirs.abs().max().item())
        report.top1_same &= same_top
        report.lines.append(f"{len(ids):4d} tokens  max|Δ| {diff:.3g}  top-1 {'same' if same_top else 'DIFFERS'}  {text!r}")
    return report
