"""The pass pipeline: one ordered list, verification between passes, IR dumps on request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from builder.errors import KilnError
from builder.ir import Graph, IRError, verify
from passes.calibrate_kv_scales import calibrate_kv_scales
from passes.canonicalize import canonicalize
from passes.clip_awq_weights import clip_awq_weights
from passes.context import PassContext
from passes.fold_awq_scales import fold_awq_scales
from passes.fuse_add_rms_norm import fuse_add_rms_norm
from passes.fuse_gate_up import fuse_gate_up
from passes.fuse_qkv import fuse_qkv
from passes.keep_source_quant import keep_source_quant
from passes.measure_accuracy import measure_accuracy
from passes.pack_weights import pack_weights
from passes.plan_memory import plan_memory
from passes.quantize_fp8 import quantize_fp8
from passes.quantize_int4 import quantize_int4
from passes.quantize_int4_gptq import quantize_int4_gptq
from passes.quantize_int8 import quantize_int8
from passes.shard_tensor_parallel import shard_tensor_parallel
from passes.split_pipeline_stages import split_pipeline_stages


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph, PassContext], Graph]
    per_rank: bool = False  # from sharding on, a pass runs once per rank on that rank's graph


PIPELINE: list[Pass] = [
    # Phase 1: clean the traced graph.
    Pass("canonicalize", canonicalize),
    # Phase 2: quantization. Before fusion, so each source weight is quantized as itself (its own
    # GGUF blocks, its own exclusion glob); fusion then stacks quantized operands row-wise.
    # Each pass acts for its plan method only. The calibration passes run on the float weights,
    # and AWQ's scales are folded before INT4 rounds the scaled weights.
    Pass("keep_source_quant", keep_source_quant),
    Pass("calibrate_kv_scales", calibrate_kv_scales),
    Pass("fold_awq_scales", fold_awq_scales),
    Pass("clip_awq_weights", clip_awq_weights),
    Pass("quantize_int8", quantize_int8),
    Pass("quantize_int4_gptq", quantize_int4_gptq),
    Pass("quantize_int4", quantize_int4),
    Pass("quantize_fp8", quantize_fp8),
    # Phase 3: fusion (exact rewrites): fewer, larger kernels per layer.
    Pass("fuse_qkv", fuse_qkv),
    Pass("fuse_gate_up", fuse_gate_up),
    Pass("fuse_add_rms_norm", fuse_add_rms_norm),
    # Analysis of the whole quantized program, before sharding splits it: perplexity and KL
    # against the float model, and the max_ppl_increase gate (a failing build writes nothing).
    Pass("measure_accuracy", measure_accuracy),
    # Phase 4: sharding; from here on each rank has its own graph. Stages are cut first, so they are
    # priced on whole layers and every tensor-parallel rank of a stage cuts at the same layers; the
    # tensor-parallel pass then slices only the weights of the rank's own stage.
    Pass("split_pipeline_stages", split_pipeline_stages, per_rank=True),
    Pass("shard_tensor_parallel", shard_tensor_parallel, per_rank=True),
    # Phase 5: kernel layouts. After sharding, which slices the logical [N, K] operands; before
    # plan_memory, which counts the packed bytes.
    Pass("pack_weights", pack_weights, per_rank=True),
    # Phase 6: analysis of each rank's final program.
    Pass("plan_memory", plan_memory, per_rank=True),
]


def pass_names() -> list[str]:
    return [p.name for p in PIPELINE]


@dataclass
class PipelineOptions:
    print_after: str | None = None   # a pass name, or "all"
    dump_dir: Path | None = None     # writes NN-<pass>[.rank<r>].txt after every pass
    debug: bool = False              # verify after every pass, not only at the boundaries
    echo: Callable[[str], None] = print


def run_pipeline(graph: Graph, ctx: PassContext, options: PipelineOptions | None = None) -> list[Graph]:
    """Run every pass in order; returns one graph per rank."""
    options = options or PipelineOptions()
    if options.print_after not in (None, "all") and options.print_after not in pass_names():
        raise KilnError(f"--print-after: no pass named {options.print_after!r} "
                        f"(passes: {', '.join(pass_names())}, or all)")
    _verify(graph, "trace", [])
    world = ctx.plan.world_size
    graphs = [graph]
    done: list[str] = []
    bar = tqdm(PIPELINE, desc="passes", unit="pass", disable=not ctx.show_progress)
    for index, step in enumerate(bar):
        bar.set_postfix_str(step.name)
        if step.per_rank and len(graphs) == 1 and world > 1:
            graphs = graphs * world  # each rank's pass picks its own share of the whole graph
        graphs = [
            step.run(g, dataclasses.replace(ctx, rank=rank if step.per_rank else 0))
            for rank, g in enumerate(graphs)
        ]
        done.append(step.name)
        if options.debug:
            for g in graphs:
                _verify(g, step.name, done[:-1])
        _show(graphs, index, step.name, options)
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


def _show(graphs: list[Graph], index: int, name: str, options: PipelineOptions) -> None:
    for rank, g in enumerate(graphs):
        suffix = f".rank{rank}" if len(graphs) > 1 else ""
        if options.print_after in ("all", name):
            options.echo(f"// IR after {name}{suffix.replace('.', ' ')}\n{g.format()}")
        if options.dump_dir is not None:
            options.dump_dir.mkdir(parents=True, exist_ok=True)
            (options.dump_dir / f"{index:02d}-{name}{suffix}.txt").write_text(g.format() + "\n")
