"""The pass pipeline: one ordered list, verification between passes, IR dumps on request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from builder.errors import KilnError
from builder.ir import Graph, IRError, verify
from passes.canonicalize import canonicalize
from passes.context import PassContext
from passes.fuse_add_rms_norm import fuse_add_rms_norm
from passes.fuse_gate_up import fuse_gate_up
from passes.fuse_qkv import fuse_qkv
from passes.plan_memory import plan_memory


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
    # Phase 3: fusion (exact rewrites): fewer, larger kernels per layer.
    Pass("fuse_qkv", fuse_qkv),
    Pass("fuse_gate_up", fuse_gate_up),
    Pass("fuse_add_rms_norm", fuse_add_rms_norm),
    # Phase 4: sharding; from here on each rank has its own graph.
    # Phase 5: analysis of each rank's final program.
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
    for index, step in enumerate(PIPELINE):
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
