"""Plan memory (analysis only): weights, activation workspace and KV blocks of one rank; fail if it does not fit.

The arithmetic is runtime.memory_plan's, which `engine-build plan` uses too: a plan the planner
says does not fit is refused here with the same message.
"""

from __future__ import annotations

import math

from builder.errors import KilnError
from builder.ir import TORCH_DTYPES, Graph
from builder.plan import load_devices
from passes.context import PassContext
from runtime.engine_format import GIB, kv_bytes_per_token
from runtime.kv_groups import group_windows
from runtime.memory_plan import RankMemoryPlan, workspace_bytes


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    plan = ctx.plan
    device = load_devices()[plan.device]
    # From the weights' types, not their tensors: those load lazily, one at a time, when emitted.
    weight_bytes = sum(math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize for w in graph.weights.values())
    layers = [n.attrs for n in graph.nodes if n.op == "attention"]
    widest = max((v.shape[-1] for v in graph.values.values() if len(v.shape) == 2 and v.shape[0] == "T"), default=0)
    # The cpu runtime gives sliding-window layers a pool of their own (runtime/kv_groups.py); the tensorrt
    # executors read every layer through one block table, so there they are priced as full layers.
    windows = group_windows(graph.meta["model"].get("layer_windows") or ()) if plan.target == "cpu" else (0,)
    memory = RankMemoryPlan(
        weight_bytes=weight_bytes,
        workspace_bytes=workspace_bytes(plan.limits.max_num_tokens, widest, plan.limits.max_batch_size,
                                        graph.meta["model"]["vocab_size"]),
        kv_bytes_per_token=kv_bytes_per_token(layers, plan.kv_cache.dtype),
        memory_bytes=device.memory_gib * GIB, memory_fraction=plan.kv_cache.memory_fraction,
        block_size=plan.kv_cache.block_size, max_seq_len=plan.limits.max_seq_len, windows=windows,
        window_bytes_per_token=kv_bytes_per_token([a for a in layers if a.get("window")], plan.kv_cache.dtype)
        if windows != (0,) else 0,
        max_batch_size=plan.limits.max_batch_size, max_num_tokens=plan.limits.max_num_tokens)
    problem = memory.problem(plan.device, ctx.rank)
    if problem:
        raise KilnError(problem)
    out = graph.replace()
    out.meta["memory"] = {
        "rank": ctx.rank,
        "weight_bytes": weight_bytes,
        "workspace_bytes": memory.workspace_bytes,
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "kv_blocks": memory.kv_blocks,
        "max_concurrency": memory.max_concurrency,
    }
    if windows != (0,):
        out.meta["memory"].update(kv_window_blocks=memory.kv_window_blocks,
                                  kv_window_bytes_per_token=memory.window_bytes_per_token)
    return out
