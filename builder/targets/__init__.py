"""Build targets: what each target accepts in a plan, the passes it adds, how it writes its ranks and what
its manifest says. One package per target, one table naming them.

A target package (builder/targets/<name>/) provides, in its __init__ (light: heavy toolchains load later):

    DEVICE_KIND        "cpu" or "gpu": the catalog devices it builds for
    ACTIVATIONS        the [quant] activations it computes in, its default first
    KV_DTYPES          the KV cache dtypes it stores
    QUANT_METHODS      the [quant] methods it builds
    check_plan(plan, device, fail)       its own constraints; fail(key, problem) raises the plan error
    layout_passes(plan) -> [Pass]        per-rank passes after sharding that lay weights out for its kernels
    prepare(plan, onnx_only)             refuse early (before any pass) what this host cannot finish
    run(pipeline, graph, ctx, options, onnx_only) -> (graphs, write_ranks or None)   the passes, and its rank
                                         writer (None: emit writes each rank's program and weights)
    requirements(plan) -> dict           the manifest's "target" section: name and what a host needs
    RANKS_ALONE        whether a rank can be built alone (--rank): its rank file is all it writes
    assemble(plan, show_progress) -> write_shared(out, rank_files) -> dict   (optional) what the ranks built
                                         alone share, written once they are all there; more manifest keys

The runtime side, the backends that run each target's engines, lives in runtime/backends.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TARGETS = {
    "cpu": "builder.targets.cpu",
    "tensorrt": "builder.targets.tensorrt",
    "cuda": "builder.targets.cuda",
}


def target(name: str) -> ModuleType:
    """The target package of `name` (ValueError naming the known ones)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    return importlib.import_module(TARGETS[name])
