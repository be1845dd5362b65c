"""The pass pipeline of one plan: the passes that apply to it, each with its parameters; verification
between passes and IR dumps on request.

`build_pipeline(plan)` is the one place that decides which passes a build runs. A pass that would
do nothing for the plan (a quantizer of another method, KV calibration for a float cache) is left
out, so the manifest's pass list, which records each pass with its parameters, is what ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from builder.measure.calibration import KV_MAX, shipped_text
from builder.errors import KilnError
from builder.graph.ir import Graph, IRError, verify
from builder.planning.plan import Plan
from builder.quant import methods
from builder.targets import target
from passes.calibrate_fp8_activations import calibrate_fp8_activations
from passes.calibrate_kv_scales import calibrate_kv_scales
from passes.canonicalize import canonicalize
from passes.choose_activations import choose_activations
from passes.clip_awq_weights import clip_awq_weights
from passes.context import PassContext
from passes.fold_awq_scales import fold_awq_scales
from passes.fuse_add_rms_norm import fuse_add_rms_norm
from passes.fuse_gate_up import fuse_gate_up
from passes.fuse_qkv import fuse_qkv
from passes.keep_source_quant import keep_source_quant
from passes.measure_accuracy import measure_accuracy
from passes.plan_memory import plan_memory
from passes.quantize_fp8 import quantize_fp8
from passes.quantize_int4 import quantize_int4
from passes.quantize_int4_gptq import quantize_int4_gptq
from passes.quantize_int8 import quantize_int8
from passes.shard_tensor_parallel import shard_tensor_parallel
from passes.split_pipeline_stages import split_pipeline_stages


@dataclass(frozen=True)
class Pass:
    """One pass of a build, with what it depends on besides the graph: its params go into the
    manifest and the build id, so a change of any of them rebuilds."""

    name: str
    run: Callable[[Graph, PassContext], Graph]
    params: dict = field(default_factory=dict)
    per_rank: bool = False  # from sharding on, a pass runs once per rank on that rank's graph

    def record(self) -> dict:
        """The pass as the manifest lists it."""
        return {"name": self.name, "params": self.params}


def build_pipeline(plan: Plan, calibration_text: str | None = None) -> list[Pass]:
    """The passes `plan` runs, in order. `calibration_text` defaults to the text shipped with Kiln."""
    quant, kv_dtype = plan.quant, plan.kv_cache.dtype
    awq = methods.method(quant.method).calibrated
    if calibration_text is None:
        calibration_text = shipped_text("calibration")
    calibrated = {"calibration_sha256": _sha256(calibration_text)}
    weights = {"method": quant.method, "group_size": quant.group_size, "exclude": list(quant.exclude)}
    sharding = {"tp": plan.tp, "pp": plan.pp, **({"ep": plan.ep} if plan.ep > 1 else {})}
    candidates = [
        # Phase 1: clean the traced graph.
        (True, Pass("canonicalize", canonicalize)),
        # Phase 2: quantization. Before fusion, so each source weight is quantized as itself (its own
        # GGUF blocks, its own exclusion glob); fusion then stacks quantized operands row-wise.
        # The calibration passes run on the float weights, and AWQ's scales are folded before INT4
        # rounds the scaled weights. "source" and every requantization method keep the file's blocks
        # (requantization: of the excluded weights).
        (quant.method != "none", Pass("keep_source_quant", keep_source_quant, weights)),
        (kv_dtype in KV_MAX,
         Pass("calibrate_kv_scales", calibrate_kv_scales, {"kv_dtype": kv_dtype, **calibrated})),
        (awq, Pass("fold_awq_scales", fold_awq_scales, {"method": quant.method, **calibrated})),
        # With gptq rounding, quantize_int4_gptq fits each group's range itself: no clipping first.
        (awq and quant.rounding != "gptq",
         Pass("clip_awq_weights", clip_awq_weights,
              {"method": quant.method, **calibrated, "rounding": quant.rounding})),
        (methods.REQUANTIZING.get(quant.method) == "int8", Pass("quantize_int8", quantize_int8, weights)),
        (awq and quant.rounding == "gptq",
         Pass("quantize_int4_gptq", quantize_int4_gptq, {**weights, "rounding": quant.rounding, **calibrated})),
        # After GPTQ: rounds what it left (nothing, for llama) or, for int4 and nearest, everything.
        (methods.REQUANTIZING.get(quant.method) == "int4", Pass("quantize_int4", quantize_int4, weights)),
        (methods.REQUANTIZING.get(quant.method) == "fp8", Pass("quantize_fp8", quantize_fp8, weights)),
        # Phase 3: fusion (exact rewrites): fewer, larger kernels per layer.
        (True, Pass("fuse_qkv", fuse_qkv)),
        (True, Pass("fuse_gate_up", fuse_gate_up)),
        (True, Pass("fuse_add_rms_norm", fuse_add_rms_norm)),
        # A target whose fp8 plans quantize activations too (tensorrt: Q/DQ for FP8 tensor cores) calibrates
        # their scales on the fused program, before the accuracy measures, which then include them.
        (quant.method == "fp8" and getattr(target(plan.target), "FP8_ACTIVATIONS", False),
         Pass("calibrate_fp8_activations", calibrate_fp8_activations, calibrated)),
        # activations = "auto" (cpu): each activation path timed on this host and measured like a lossy plan; the
        # fastest that keeps the greedy gate is the program's (measure_accuracy reuses its figures).
        (quant.activations == "auto",
         Pass("choose_activations", choose_activations,
              {"min_greedy_agreement": quant.min_greedy_agreement,
               "evaluation_sha256": _sha256(shipped_text("evaluation")),
               "chat_prompts_sha256": _sha256(shipped_text("chat_prompts"))})),
        # Analysis of the whole quantized program, before sharding splits it: perplexity, KL and
        # greedy chat agreement against the float model, and the max_ppl_increase and
        # min_greedy_agreement gates (a failing build writes nothing). A float build with an f32
        # cache loses nothing to measure.
        (quant.method != "none" or kv_dtype != "f32",
         Pass("measure_accuracy", measure_accuracy,
              {"max_ppl_increase": quant.max_ppl_increase, "min_greedy_agreement": quant.min_greedy_agreement,
               "evaluation_sha256": _sha256(shipped_text("evaluation")),
               "chat_prompts_sha256": _sha256(shipped_text("chat_prompts"))})),
        # Phase 4: sharding; from here on each rank has its own graph. Stages are cut first, so they
        # are priced on whole layers and every tensor-parallel rank of a stage cuts at the same
        # layers; the tensor-parallel pass then slices only the weights of the rank's own stage.
        # Both run on one rank too: they record the rank's place (mapping, stage, share) in the program.
        (True, Pass("split_pipeline_stages", split_pipeline_stages, sharding, per_rank=True)),
        (True, Pass("shard_tensor_parallel", shard_tensor_parallel, sharding, per_rank=True)),
        # Phase 5: the target's kernel layouts (builder/targets: the cpu target's panels, the cuda target's
        # nibbles). After sharding, which slices the logical [N, K] operands; before plan_memory, which counts
        # the packed bytes.
        *((True, step) for step in target(plan.target).layout_passes(plan)),
        # Phase 6: analysis of each rank's final program.
        (True, Pass("plan_memory", plan_memory, {"device": plan.device, "kv_cache": plan.to_dict()["kv_cache"]},
                    per_rank=True)),
    ]
    return [step for applies, step in candidates if applies]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class PipelineOptions:
    print_after: str | None = None   # a pass name, or "all"
    dump_dir: Path | None = None     # writes NN-<pass>[.rank<r>].txt after every pass
    debug: bool = False              # verify after every pass, not only at the boundaries
    echo: Callable[[str], None] = print


def run_pipeline(graph: Graph, ctx: PassContext, passes: list[Pass],
                 options: PipelineOptions | None = None) -> list[Graph]:
    """Run `passes` in order; returns one graph per rank (ctx.only_rank: that rank's alone)."""
    options = options or PipelineOptions()
    names = [p.name for p in passes]
    if options.print_after not in (None, "all") and options.print_after not in names:
        raise KilnError(f"--print-after: no pass named {options.print_after!r} in this build's pipeline "
                        f"(passes that run: {', '.join(names)}, or all)")
    _verify(graph, "trace", [])
    world = ctx.plan.world_size
    graphs = [graph]
    ranks: list[int] | None = None  # the rank of each graph once sharding has begun (--rank: the one rank built)
    done: list[str] = []
    bar = tqdm(passes, desc="passes", unit="pass", disable=not ctx.show_progress)
    for index, step in enumerate(bar):
        bar.set_postfix_str(step.name)
        if step.per_rank and ranks is None:
            ranks = list(range(world)) if ctx.only_rank is None else [ctx.only_rank]
            graphs = graphs * len(ranks)  # each rank's pass picks its own share of the whole graph
        graphs = [
            step.run(g, dataclasses.replace(ctx, rank=rank if step.per_rank else 0))
            for rank, g in zip(ranks or [0], graphs)
        ]
        done.append(step.name)
        if options.debug:
            for g in graphs:
                _verify(g, step.name, done[:-1])
        _show(graphs, ranks, world, index, step.name, options)
    bar.close()
    for g in graphs:
        _verify(g, done[-1] if done else "trace", done[:-1])
    return graphs


def _verify(graph: Graph, after: str, before: list[str]) -> None:
    try:
        verify(graph)
    except IRError as exc:
        history = f" (after {', '.join(before)})" if before else ""
        raise KilnError(f"IR invalid after pass {after!r}{history}: {exc}") from None


def _show(graphs: list[Graph], ranks: list[int] | None, world: int, index: int, name: str,
          options: PipelineOptions) -> None:
    """ranks: each graph's rank once sharding has begun (None before: the one whole graph)."""
    for rank, g in zip(ranks or [0], graphs):
        suffix = f".rank{rank}" if ranks is not None and world > 1 else ""
        if options.print_after in ("all", name):
            options.echo(f"// IR after {name}{suffix.replace('.', ' ')}\n{g.format()}")
        if options.dump_dir is not None:
            options.dump_dir.mkdir(parents=True, exist_ok=True)
            (options.dump_dir / f"{index:02d}-{name}{suffix}.txt").write_text(g.format() + "\n")
