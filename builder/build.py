"""One build: model source + plan -> traced graph -> pass pipeline -> engine directory."""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from builder import emit
from builder.planning.build_budget import check_host
from builder.measure.calibration import model_tokenizer
from builder.errors import KilnError
from builder.sources.lazy_tensors import LazyTensors
from builder.sources import load_model
from builder.pipeline import PipelineOptions, build_pipeline
from builder.planning.plan import Plan
from builder.planning.shapes import load_shape
from builder.targets import target
from builder.graph.trace import trace
from passes.context import PassContext
from passes.quant_rewrite import weight_nodes
from runtime import __version__
from runtime.format.engine_format import manifest_header


@dataclass
class BuildResult:
    out: Path
    manifest: dict    # the engine's manifest; for a --rank build, the rank's part (builder/emit.py's emit_rank)
    up_to_date: bool  # the directory already held this exact engine; nothing was written


def build_engine(model_source: str, plan: Plan, out: Path, *, force: bool = False,
                 options: PipelineOptions | None = None, show_progress: bool = True,
                 calibration_text: str | None = None, onnx_only: bool = False, rank: int | None = None) -> BuildResult:
    """rank: build that rank alone into `out` (its file and part, beside other ranks' parts of the same build); a
    build without `rank` whose `out` holds every rank's part assembles them instead of building."""
    if rank is not None:
        if not target(plan.target).RANKS_ALONE:
            raise KilnError(f"--rank: a {plan.target} build checks its ranks' engines against each other (the ONNX "
                            f"across ranks): build a {plan.target} plan whole; --rank takes cpu and cuda plans")
        if not 0 <= rank < plan.world_size:
            experts = f" ep {plan.ep}" if plan.ep > 1 else ""
            raise KilnError(f"--rank {rank}: the plan has {plan.world_size} rank(s) "
                            f"(tp {plan.tp}{experts} x pp {plan.pp}), numbered 0 to {plan.world_size - 1}")
    model = load_model(model_source)
    identity = {"name": model.name, "architecture": model.config.architecture,
                "config": model.config.to_dict(), "weights_sha256": model.weights_sha256(),
                "special_tokens": model_tokenizer(model)[2].to_dict()}
    if calibration_text is None and plan.quant.calib is not None:
        calibration_text = _read_calibration(plan.quant.calib)
    pipeline = build_pipeline(plan, calibration_text)
    passes = [step.record() for step in pipeline]
    build_id = emit.build_id(identity, plan.to_dict(), passes + ([{"name": "onnx_only"}] if onnx_only else []))
    kind = target(plan.target)
    kind.prepare(plan, onnx_only)  # before any work: can this host finish the build?
    if rank is None:
        if emit.is_up_to_date(out, build_id):
            return BuildResult(out, json.loads((out / "manifest.json").read_text()), True)
        parts, missing = emit.parts_state(out, build_id, plan.world_size) if out.is_dir() else ([], [])
        if parts and not missing:  # every rank was built alone (--rank): put the engine together
            shared = getattr(kind, "assemble", None)
            return BuildResult(out, emit.assemble(out, model, parts, shared and shared(plan, show_progress)), False)
        if parts:
            raise KilnError(f"--out {out}: holds the parts of ranks {', '.join(str(p['rank']) for p in parts)} of "
                            f"this build, not of ranks {', '.join(map(str, missing))}: build those with --rank, or "
                            "pass --force to build the whole engine")
        emit.check_output_dir(out, force)
    else:
        done = emit.rank_up_to_date(out, build_id, rank, plan.world_size)
        if done is not None:
            return BuildResult(out, done, True)
        emit.check_parts_dir(out, build_id, force)
    shape = model_shape(model_source)
    if shape is not None:
        check_host(shape, plan, rank)  # before a weight is read

    graph = trace(model)
    # Weights are read from the source when a pass or the emitter needs them, never all at once.
    graph.tensors = LazyTensors({name: functools.partial(model.load, name) for name in graph.weights})
    ctx = PassContext(plan=plan, model=model, calibration_text=calibration_text, show_progress=show_progress,
                      only_rank=rank)
    graphs, write_ranks = kind.run(pipeline, graph, ctx, options, onnx_only)
    # The figures go into the manifest and report, not into every rank's program.
    accuracy = [g.meta.pop("accuracy", None) for g in graphs][0]
    choice = [g.meta.pop("activation_choice", None) for g in graphs][0]
    for g in graphs:
        g.meta.pop("activation_figures", None)

    manifest = {
        **manifest_header(__version__),
        "build_id": build_id,
        "model": dict(identity, source=str(model.source)),
        "plan": plan.to_dict(),
        "passes": passes,
        "target": kind.requirements(plan),
        "world_size": plan.world_size,
        "quantization": _quantization_summary(plan, graphs[0]),
    }
    if accuracy:
        manifest["accuracy"] = accuracy
    if choice:
        manifest["activation_choice"] = choice
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:  # reproducible-builds convention: a build time only when the caller fixes it
        manifest["build_time"] = int(epoch)
    if rank is not None:
        return BuildResult(out, emit.emit_rank(out, graphs[0], rank, plan.world_size, manifest), False)
    return BuildResult(out, emit.emit(out, graphs, model, manifest, show_progress, write_ranks), False)


def model_shape(model_source: str):
    """The model's shape as the planner reads it (builder/planning/build_budget.py prices the build with it), or None for a
    source planning cannot read (the build then goes on unpriced)."""
    try:
        return load_shape(model_source)
    except KilnError:
        return None


def _read_calibration(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"[quant] calib {path}: cannot read the calibration text ({exc})") from None


def _quantization_summary(plan: Plan, graph) -> dict:
    """How the weights of rank 0 are stored and computed (counts of weight nodes per format)."""
    formats = Counter()
    for node in weight_nodes(graph):
        a = node.attrs
        quant = a.get("quant", "none")
        formats[quant if quant == "none" or not a.get("group_size") else f"{quant} g{a['group_size']}"] += 1
    summary = {"method": plan.quant.method, "kv_cache_dtype": plan.kv_cache.dtype,
               "nodes": dict(sorted(formats.items()))}
    if target(plan.target).KERNELS_WIDEN and set(formats) != {"none"}:
        act_nodes = sum(n.attrs.get("act") == plan.quant.activations for n in weight_nodes(graph))
        summary["compute"] = ("weights stay quantized in memory and are widened inside the kernels; f32 activations"
                              + (f", {plan.quant.activations} per token in {act_nodes} int4/int8 linears"
                                 if act_nodes else ""))
    if plan.quant.method == "fp8" or plan.kv_cache.dtype == "fp8":
        summary["fp8"] = ("stored as e4m3 with f32 scales, computed in f32 on the cpu target; "
                          "the tensorrt target runs it as FP8 Q/DQ on FP8 tensor cores")
    return summary
