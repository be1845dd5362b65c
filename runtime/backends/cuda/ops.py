"""The cuda backend's kernel for each IR op: Program binders over device tensors (runtime/ops/program.py).

Norms, RoPE, gated activations and attention run Kiln's Triton kernels (runtime/backends/cuda/kernels/) through
the executor's launcher; int4 and fp8 linears run the weight-only GEMV/GEMM kernels; float linears, the
embedding gather, adds and the last-token gather use torch (cuBLAS on a GPU). Activations stay in the plan's
dtype (bf16, f16 or f32) from the embedding to the logits, which leave as f32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.backends.cuda.kernels import experts as experts_kernel
from runtime.backends.cuda.kernels import gemm, rows
from runtime.backends.cuda.launch import Launcher
from runtime.ops import moe, reference


# (token, expert) pairs per held expert above which a step with quantized experts groups its tokens by expert
# (outside CUDA graphs: decode steps a graph captures keep one launch a pair). Measured on an H100 (a random
# 8-expert top-2 model, hidden 1024, expert MLP 2816): a 512-token prefill with int4 experts ran at 1.7k tok/s one
# launch a pair, 11.7k-16.9k grouped; with bf16 experts the pairs' launches were the faster (22.0-23.2k against
# 12.6k tok/s), so float experts always run by pairs. Decode at batch 64 with int4 experts: 40.6 ms a step by pairs
# in a graph, 54.6 ms grouped outside one (gemm's int4 GEMM costs ~0.3 ms a call at 16 rows), so graphs stay.
GROUPED_PER_EXPERT = 2


@dataclass(frozen=True)
class OpContext:
    launcher: Launcher
    dtype: torch.dtype                            # activations
    rope_table: Callable[[dict], torch.Tensor]    # a rope node's attrs -> its cos | sin rows on the device


def make_binders(ctx: OpContext) -> dict:
    """op -> binder (Site -> callable), as runtime.ops.program.BINDERS, for device tensors."""
    launcher = ctx.launcher

    def bind_linear(site):
        attrs, ops = site.attrs, site.operands()
        bias = ops.get("bias")
        bias = None if bias is None else bias.float()
        quant = attrs.get("quant", "none")
        if quant == "none":
            weight = ops["weight"]
            bias_cast = None if bias is None else bias.to(weight.dtype)
            return lambda x: F.linear(x, weight, bias_cast)
        if quant == "int4":
            q, s, z, g = ops["qweight"], ops["scales"], ops["zeros"], attrs["group_size"]
            return lambda x: gemm.linear_int4(launcher, x.contiguous(), q, s, z, g, bias)
        if quant == "fp8":
            q, s = ops["qweight"], ops["scales"]
            return lambda x: gemm.linear_fp8(launcher, x.contiguous(), q, s, bias)
        raise ValueError(f"program: {site.node['name']}: {quant} weights have no cuda kernel (the cuda target "
                         "stores them as int4, fp8 or floats; rebuild the engine)")

    def bind_logits(site):
        run = bind_linear(site)
        return lambda x: run(x).float()

    def bind_embedding(site):
        a = site.attrs
        weight, scale = site.operands()["weight"], a.get("scale", 1.0)
        start, vocab = a.get("vocab_start", 0), a["vocab_size"]
        if start == 0 and vocab == a.get("full_vocab_size", vocab):
            rows = lambda tokens: weight.index_select(0, tokens)  # noqa: E731
        else:  # this rank's rows of a vocabulary sharded over tp ranks: the others' tokens give 0 (all-reduced)
            def rows(tokens):
                local = tokens - start
                inside = (local >= 0) & (local < vocab)
                return weight.index_select(0, local.clamp(0, vocab - 1)) * inside[:, None]
        return rows if scale == 1.0 else (lambda tokens: rows(tokens) * scale)

    def bind_rms_norm(site):
        weight, eps = site.weights[0].float().contiguous(), site.attrs["eps"]
        return lambda x: rows.rms_norm(launcher, x, weight, eps)

    def bind_add_rms_norm(site):
        weight, eps = site.weights[0].float().contiguous(), site.attrs["eps"]
        return lambda x, residual: rows.add_rms_norm(launcher, x, residual, weight, eps)

    def bind_head_rms_norm(site):
        weight, eps = site.weights[0].float().contiguous(), site.attrs["eps"]
        return lambda x: rows.head_rms_norm(launcher, x, weight, eps)

    def bind_gated(site):
        act = site.attrs.get("act", "silu")
        return lambda *xs: rows.gated_act(launcher, act, *xs)

    def bind_split(site):
        sizes = site.attrs["sizes"]
        return lambda x: reference.split(x, sizes)

    def bind_rope(site):
        a = site.attrs
        table = ctx.rope_table(a)
        return lambda q, k, positions: rows.rope(launcher, q, k, positions, table, a["num_heads"], a["num_kv_heads"],
                                                 a["head_dim"])

    def bind_moe(site):
        """Routing with torch on the device; the experts' weights stacked [E, N, K] here, once; the shared expert as
        linears. A step runs every (token, expert) pair's projections in one expert_gemv launch each, decided on
        the device (so CUDA graphs capture decode steps), except a step with quantized experts and more than
        GROUPED_PER_EXPERT pairs per held expert outside a graph (a prefill): it groups its tokens by expert (one
        host synchronisation a layer) and runs each chosen expert's projections once over its tokens with gemm's
        kernels, accumulating in f32."""
        a, node = site.attrs, site.node
        operands = moe.operands_by_linear(node, site.tensors)
        linear = {e["name"]: bind_linear(_LinearSite(e, operands[e["name"]])) for e in moe.held_linears(a)
                  if not e["name"].startswith("experts.")}
        held, top_k = a["experts"], a["top_k"]
        entries = {e["name"]: e for e in a["linears"]}
        parts = ("gate_up_proj",) if f"experts.{held[0]}.gate_up_proj" in entries else ("gate_proj", "up_proj")
        gate_up = _stack_experts(node["name"], [[(entries[f"experts.{e}.{p}"], operands[f"experts.{e}.{p}"])
                                                 for p in parts] for e in held])
        down = _stack_experts(node["name"], [[(entries[f"experts.{e}.down_proj"], operands[f"experts.{e}.down_proj"])]
                                             for e in held])
        device = gate_up.weight.device
        local = torch.full((a["num_experts"],), -1, dtype=torch.int32, device=device)  # global id -> held index
        local[torch.tensor(held, dtype=torch.int64, device=device)] = torch.arange(len(held), dtype=torch.int32,
                                                                                   device=device)
        act = a["act"]
        index = {e: i for i, e in enumerate(held)}
        one = [(_expert_linear(launcher, gate_up, i), _expert_linear(launcher, down, i)) for i in range(len(held))]

        def grouped(x, weights, ids):
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=a["num_experts"]).tolist()
            out, slot_weights, start = torch.zeros(x.shape, dtype=torch.float32, device=x.device), weights.flatten(), 0
            for expert, count in enumerate(counts):
                picked, start = order[start:start + count], start + count
                if count and expert in index:
                    first, second = one[index[expert]]
                    tokens = picked // top_k
                    h = second(rows.gated_act(launcher, act, first(x.index_select(0, tokens))))
                    out.index_add_(0, tokens, h.float() * slot_weights[picked, None])
            return out.to(x.dtype)

        def run(x):
            weights, ids = reference.route(linear["router"](x), top_k, a["norm_topk_prob"])
            x = x.contiguous()
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            if x.device.type == "meta":  # the build's dry run: the grouped path's kernels too (one and many rows)
                first, second = one[0]
                for h in (x[:1], x):
                    second(rows.gated_act(launcher, act, first(h)))
            elif gate_up.format != "float" and not capturing and x.shape[0] * top_k > GROUPED_PER_EXPERT * len(held):
                out = grouped(x, weights, ids)
                return out + shared_out(x) if a.get("shared", False) else out
            slots = local[ids.flatten()]
            hidden = experts_kernel.expert_gemv(launcher, x, slots, gate_up, top_k)
            y = experts_kernel.expert_gemv(launcher, rows.gated_act(launcher, act, hidden), slots, down, 1)
            out = (y.view(x.shape[0], top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)
            return out + shared_out(x) if a.get("shared", False) else out

        def shared_out(x):
            gated = rows.gated_act(launcher, act, linear["shared_expert.gate_up_proj"](x)) \
                if "shared_expert.gate_up_proj" in linear else \
                rows.gated_act(launcher, act, linear["shared_expert.gate_proj"](x), linear["shared_expert.up_proj"](x))
            return torch.sigmoid(linear["shared_expert_gate"](x)) * linear["shared_expert.down_proj"](gated)

        return run

    def collective(op: str):
        def bind(site):
            hook = getattr(site.hooks, op)
            return hook and (lambda x: hook(x, site.attrs))
        return bind

    return {
        "linear": bind_linear,
        "logits": bind_logits,
        "embedding": bind_embedding,
        "rms_norm": bind_rms_norm,
        "add_rms_norm": bind_add_rms_norm,
        "head_rms_norm": bind_head_rms_norm,
        "split": bind_split,
        "rope": bind_rope,
        "attention": lambda site: site.hooks.attention(site.attrs),
        "silu_mul": bind_gated,
        "moe": bind_moe,
        "add": lambda site: torch.add,
        "gather_last": lambda site: site.hooks.gather_last,
        "all_reduce": collective("all_reduce"),
        "all_gather": collective("all_gather"),
        "send": lambda site: lambda x: site.hooks.send(x, site.attrs),
        "recv": lambda site: lambda: site.hooks.recv(site.attrs),
    }


@dataclass(frozen=True)
class _LinearSite:
    """A linear inside a moe node, as the linear binder sees a linear node."""

    attrs: dict
    ops: dict

    def operands(self) -> dict:
        return self.ops


def _stack_experts(node: str, experts: list[list[tuple[dict, dict]]]) -> experts_kernel.Experts:
    """One projection of every held expert stacked for expert_gemv: each expert's parts (gate and up: stacked row
    after row) as (linear attrs, operands), all of one format (float, int4 of one group size, or fp8)."""
    kinds = {(attrs.get("quant", "none"), attrs.get("group_size")) for parts in experts for attrs, _ in parts}
    if len(kinds) != 1:
        raise ValueError(f"program: {node}: its experts' weights mix formats {sorted(map(str, kinds))}; the cuda "
                         "backend stacks one format (rebuild with one [quant] method for the experts)")
    (quant, group), = kinds

    def stacked(role: str) -> torch.Tensor:
        return torch.stack([torch.cat([ops[role] for _, ops in parts]) for parts in experts]).contiguous()

    if quant == "none":
        return experts_kernel.Experts("float", stacked("weight"))
    if quant == "int4":
        return experts_kernel.Experts("int4", stacked("qweight"), stacked("scales"), stacked("zeros"), group)
    if quant == "fp8":  # a scale per output channel (a per-tensor one repeated)
        scales = torch.stack([torch.cat([ops["scales"].float().reshape(-1).expand(attrs["out_features"])
                                         for attrs, ops in parts]) for parts in experts]).contiguous()
        return experts_kernel.Experts("fp8", stacked("qweight").view(torch.uint8), scales)
    raise ValueError(f"program: {node}: {quant} expert weights have no cuda kernel (rebuild the engine)")


def _expert_linear(launcher: Launcher, stack: experts_kernel.Experts, i: int):
    """x [rows, K] -> [rows, N] through held expert i's weights in `stack`, with gemm's kernels (GEMV or GEMM by the
    row count) or, for float weights, torch's."""
    weight = stack.weight[i]
    if stack.format == "float":
        return lambda x: F.linear(x, weight)
    if stack.format == "int4":
        scales, zeros = stack.scales[i], stack.zeros[i]
        return lambda x: gemm.linear_int4(launcher, x, weight, scales, zeros, stack.group)
    codes, scales = weight.view(torch.float8_e4m3fn), stack.scales[i]
    return lambda x: gemm.linear_fp8(launcher, x, codes, scales)
