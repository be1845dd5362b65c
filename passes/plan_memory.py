"""Plan memory (analysis only): weights, activation workspace and KV blocks of one rank; fail if it does not fit."""

from __future__ import annotations

import math

from builder.errors import KilnError
from builder.ir import TORCH_DTYPES, Graph
from builder.plan import load_devices
from passes.context import PassContext

KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1, "int8": 1}
GIB = 1 << 30


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    plan = ctx.plan
    device = load_devices()[plan.device]
    # From the weights' types, not their tensors: those load lazily, one at a time, when emitted.
    weight_bytes = sum(math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize for w in graph.weights.values())
    layers = [n.attrs for n in graph.nodes if n.op == "attention"]
    kv_bytes_per_token = sum(2 * a["num_kv_heads"] * a["head_dim"] for a in layers) * KV_BYTES[plan.kv_cache.dtype]
    widest = max((v.shape[-1] for v in graph.values.values() if len(v.shape) == 2 and v.shape[0] == "T"), default=0)
    # A handful of [max_num_tokens, widest] float32 activations are alive at once, plus the logits.
    vocab = graph.meta["model"]["vocab_size"]
    workspace = 4 * (6 * plan.limits.max_num_tokens * widest + plan.limits.max_batch_size * vocab)
    budget = device.memory_gib * GIB
    free = budget - weight_bytes - workspace
    block_bytes = kv_bytes_per_token * plan.kv_cache.block_size
    kv_blocks = int(free * plan.kv_cache.memory_fraction // block_bytes) if block_bytes and free > 0 else 0
    blocks_per_seq = -(-plan.limits.max_seq_len // plan.kv_cache.block_size)
    if layers and kv_blocks < blocks_per_seq:
        raise KilnError(
            f"plan does not fit {plan.device} ({device.memory_gib:g} GiB) on rank {ctx.rank}: weights "
            f"{weight_bytes / GIB:.2f} GiB + workspace {workspace / GIB:.2f} GiB leave room for {kv_blocks} KV "
            f"blocks, one sequence of max_seq_len={plan.limits.max_seq_len} needs {blocks_per_seq}; lower "
            f"max_seq_len or max_num_tokens, raise kv_cache.memory_fraction, quantize, or add ranks")
    out = graph.replace()
    out.meta["memory"] = {
        "rank": ctx.rank,
        "weight_bytes": weight_bytes,
        "workspace_bytes": workspace,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_blocks": kv_blocks if layers else 0,
        "max_concurrency": kv_blocks // blocks_per_seq if layers else 0,
    }
    return out
