"""Plan memory (analysis only): weights, activation workspace and KV blocks of one rank; fail if it does not fit."""

from __future__ import annotations

import math

from builder.errors import KilnError
from builder.ir import TORCH_DTYPES, Graph
from builder.plan import load_devices
from passes.context import PassContext
from runtime.engine_format import GIB, kv_blocks, kv_bytes_per_token


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    plan = ctx.plan
    device = load_devices()[plan.device]
    # From the weights' types, not their tensors: those load lazily, one at a time, when emitted.
    weight_bytes = sum(math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize for w in graph.weights.values())
    layers = [n.attrs for n in graph.nodes if n.op == "attention"]
    bytes_per_token = kv_bytes_per_token(layers, plan.kv_cache.dtype)
    widest = max((v.shape[-1] for v in graph.values.values() if len(v.shape) == 2 and v.shape[0] == "T"), default=0)
    # A handful of [max_num_tokens, widest] float32 activations are alive at once, plus the logits.
    vocab = graph.meta["model"]["vocab_size"]
    workspace = 4 * (6 * plan.limits.max_num_tokens * widest + plan.limits.max_batch_size * vocab)
    budget = device.memory_gib * GIB
    free = budget - weight_bytes - workspace
    blocks = kv_blocks(free * plan.kv_cache.memory_fraction, bytes_per_token, plan.kv_cache.block_size)
    blocks_per_seq = -(-plan.limits.max_seq_len // plan.kv_cache.block_size)
    if layers and blocks < blocks_per_seq:
        raise KilnError(
            f"plan does not fit {plan.device} ({device.memory_gib:g} GiB) on rank {ctx.rank}: weights "
            f"{weight_bytes / GIB:.2f} GiB + workspace {workspace / GIB:.2f} GiB leave room for {blocks} KV "
            f"blocks, one sequence of max_seq_len={plan.limits.max_seq_len} needs {blocks_per_seq}; lower "
            f"max_seq_len or max_num_tokens, raise kv_cache.memory_fraction, quantize, or add ranks")
    out = graph.replace()
    out.meta["memory"] = {
        "rank": ctx.rank,
        "weight_bytes": weight_bytes,
        "workspace_bytes": workspace,
        "kv_bytes_per_token": bytes_per_token,
        "kv_blocks": blocks if layers else 0,
        "max_concurrency": blocks // blocks_per_seq if layers else 0,
    }
    return out
