"""Plan memory (analysis only): weights, activation workspace and KV blocks of one rank; fail if it does not fit.

The arithmetic is runtime.format.memory_plan's, which `engine-build plan` uses too: a plan the planner
says does not fit is refused here with the same message.
"""

from __future__ import annotations

import math

from builder.errors import KilnError
from builder.graph.ir import TORCH_DTYPES, Graph
from builder.targets import target
from builder.planning.plan import load_devices
from passes.context import PassContext
from runtime.format.engine_format import GIB, kv_bytes_per_token
from runtime.format.kv_groups import group_windows
from runtime.format.memory_plan import RankMemoryPlan, workspace_bytes


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    out.meta["memory"] = memory_record(rank_memory(graph, ctx.plan, ctx.rank), ctx.rank)
    experts = expert_bytes(graph)
    if experts:  # a step reads only its tokens' experts: what runtime/measure/bench.py's roofline counts
        out.meta["memory"]["expert_bytes"] = experts
    return out


def expert_bytes(graph: Graph) -> int:
    """Bytes of the routed experts' weights of the rank (their routers and the shared experts excluded)."""
    total = 0
    for node in graph.nodes:
        if node.op != "moe":
            continue
        at = 1
        for linear in node.attrs["linears"]:
            names = node.inputs[at:at + len(linear["operands"])]
            at += len(names)
            if linear["name"].startswith("experts."):
                total += sum(math.prod(graph.weights[n].shape) * TORCH_DTYPES[graph.weights[n].dtype].itemsize
                             for n in names)
    return total


def rank_memory(graph: Graph, plan, rank: int, workspace: int | None = None) -> RankMemoryPlan:
    """The rank's memory plan, a KilnError naming what to change when it does not fit. workspace: the activation
    memory the engine is known to need (a tensorrt engine's, from TensorRT) in place of the estimate."""
    device = load_devices()[plan.device]
    # From the weights' types, not their tensors: those load lazily, one at a time, when emitted.
    weight_bytes = sum(math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize for w in graph.weights.values())
    layers = [n.attrs for n in graph.nodes if n.op == "attention"]
    widest = max((v.shape[-1] for v in graph.values.values() if len(v.shape) == 2 and v.shape[0] == "T"), default=0)
    # The cpu runtime gives sliding-window layers a pool of their own (runtime/format/kv_groups.py); the tensorrt
    # executors read every layer through one block table, so there they are priced as full layers.
    windows = group_windows(graph.meta["model"].get("layer_windows") or ()) if target(plan.target).WINDOWED_POOLS else (0,)
    if workspace is None:
        workspace = workspace_bytes(plan.limits.max_num_tokens, widest, plan.limits.max_batch_size,
                                    graph.meta["model"]["vocab_size"], target(plan.target).LIVE_ACTIVATIONS)
    memory = RankMemoryPlan(
        weight_bytes=weight_bytes, workspace_bytes=workspace,
        kv_bytes_per_token=kv_bytes_per_token(layers, plan.kv_cache.dtype),
        memory_bytes=device.memory_gib * GIB, memory_fraction=plan.kv_cache.memory_fraction,
        block_size=plan.kv_cache.block_size, max_seq_len=plan.limits.max_seq_len, windows=windows,
        window_bytes_per_token=kv_bytes_per_token([a for a in layers if a.get("window")], plan.kv_cache.dtype)
        if windows != (0,) else 0,
        max_batch_size=plan.limits.max_batch_size, max_num_tokens=plan.limits.max_num_tokens)
    problem = memory.problem(plan.device, rank)
    if problem:
        raise KilnError(problem)
    return memory


def memory_record(memory: RankMemoryPlan, rank: int) -> dict:
    """The rank's memory plan as the graph's meta (and the manifest) record it."""
    record = {
        "rank": rank,
        "weight_bytes": memory.weight_bytes,
        "workspace_bytes": memory.workspace_bytes,
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "kv_blocks": memory.kv_blocks,
        "max_concurrency": memory.max_concurrency,
    }
    if memory.windows != (0,):
        record.update(kv_window_blocks=memory.kv_window_blocks, kv_window_bytes_per_token=memory.window_bytes_per_token)
    return record
