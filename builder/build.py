"""One build: model source + plan -> traced graph -> pass pipeline -> engine directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from builder import emit
from builder.model import load_model
from builder.pipeline import PIPELINE, PipelineOptions, run_pipeline
from builder.plan import Plan, load_devices
from builder.trace import trace
from passes.context import PassContext
from runtime import ENGINE_FORMAT, FORMAT_VERSION, __version__

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class BuildResult:
    out: Path
    manifest: dict
    up_to_date: bool  # the directory already held this exact engine; nothing was written


def build_engine(model_source: str, plan: Plan, out: Path, *, force: bool = False,
                 options: PipelineOptions | None = None, show_progress: bool = True,
                 calibration_text: str | None = None) -> BuildResult:
    model = load_model(model_source)
    identity = {"name": model.name, "architecture": model.config.architecture,
                "config": model.config.to_dict(), "weights_sha256": model.weights_sha256()}
    passes = [{"name": p.name, "params": _pass_params(p.name, plan)} for p in PIPELINE]
    build_id = emit.build_id(identity, plan.to_dict(), passes)
    if emit.is_up_to_date(out, build_id):
        import json

        return BuildResult(out, json.loads((out / "manifest.json").read_text()), True)
    emit.check_output_dir(out, force)

    graph = trace(model)
    for name in tqdm(sorted(graph.weights), desc="loading weights", unit="tensor", disable=not show_progress):
        graph.tensors[name] = model.load(name)
    ctx = PassContext(plan=plan, model=model, calibration_text=calibration_text)
    graphs = run_pipeline(graph, ctx, options)

    manifest = {
        "format": ENGINE_FORMAT,
        "format_version": FORMAT_VERSION,
        "kiln_version": __version__,
        "build_id": build_id,
        "model": dict(identity, source=str(model.source)),
        "plan": plan.to_dict(),
        "passes": passes,
        "target": _target_requirements(plan),
        "world_size": plan.world_size,
    }
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:  # reproducible-builds convention: a build time only when the caller fixes it
        manifest["build_time"] = int(epoch)
    return BuildResult(out, emit.emit(out, graphs, model, manifest, show_progress), False)


def _pass_params(name: str, plan: Plan) -> dict:
    if name.startswith("quantize"):
        return {"method": plan.quant.method, "group_size": plan.quant.group_size,
                "exclude": list(plan.quant.exclude)}
    if name == "plan_memory":
        return {"device": plan.device, "kv_cache": plan.to_dict()["kv_cache"]}
    if name in ("shard_tensor_parallel", "split_pipeline_stages"):
        return {"tp": plan.tp, "pp": plan.pp}
    return {}


def _target_requirements(plan: Plan) -> dict:
    if plan.target == "cpu":
        return {"name": "cpu", "requires": {"cpu_flags": emit.CPU_FLAGS}}
    device = load_devices()[plan.device]
    return {"name": plan.target, "requires": {"gpu_arch": device.arch}}
