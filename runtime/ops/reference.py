"""Torch reference kernels of the IR's dense ops: what the tracer's leaves compute and the C kernels are tested against.

rms_norm, add_rms_norm and silu_mul here are the references; programs bind the C versions in
runtime.ops.rowops. make_rope binds a rope node's table once and returns a callable over
(q, k, positions); RopeTable is also the fused attention kernel's table.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def scaling_key(scaling: dict | None) -> tuple | None:
    """A rope scaling dict as a hashable key (its lists, LongRoPE's factors, as tuples)."""
    if not scaling:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in scaling.items()))


@lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, scaling_key: tuple | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2]; `long` picks LongRoPE's long factors."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling_key is None:
        return inv_freq
    scaling = dict(scaling_key)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, scaled)


class RopeTable:
    """cos/sin rows by position, grown on demand: [positions, head_dim]; `packed` is [positions, head_dim]
    = cos | sin of the first half (the C kernels' layout; the halves of cos and sin repeat).

    LongRoPE (Phi-3) rows use the short factors below original_max_position_embeddings and the long
    ones from there on, all scaled by the attention factor. transformers switches a whole sequence to
    the long factors once it grows past that length; a paged cache cannot re-rotate the keys it holds,
    so Kiln (like vLLM) chooses by position: equal for every sequence within the original length.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        key = scaling_key(scaling)
        self.inv_freq = _inv_freq(head_dim, float(theta), key)
        self.long_from, self.long_inv_freq, self.mscale = None, None, 1.0
        if scaling and scaling.get("rope_type") == "longrope":
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.long_inv_freq = _inv_freq(head_dim, float(theta), key, long=True)
            self.mscale = float(scaling["attention_factor"])
        self.cos = self.sin = self.packed = torch.empty(0, head_dim)

    def ensure(self, rows: int) -> None:
        """Cover positions 0 .. rows - 1."""
        if rows > self.cos.shape[0]:
            size = max(rows, 2 * self.cos.shape[0], 256)
            positions = torch.arange(size, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)
            if self.long_from is not None:
                long = positions[self.long_from:]
                freqs[self.long_from:] = torch.outer(long, self.long_inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
            if self.mscale != 1.0:
                self.cos, self.sin = self.cos * self.mscale, self.sin * self.mscale
            half = self.cos.shape[1] // 2
            self.packed = torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=1).contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ensure(int(positions.max()) + 1 if positions.numel() else 0)
        return self.cos[positions], self.sin[positions]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    t = x.shape[0]
    x = x.reshape(t, heads, -1)  # [T, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).reshape(t, -1)


def make_rope(attrs: dict):
    table = RopeTable(attrs["head_dim"], attrs["theta"], attrs.get("scaling"))
    nh, nkv = attrs["num_heads"], attrs["num_kv_heads"]

    def rope(q, k, positions):
        cos, sin = table.lookup(positions)
        return _rotate(q, cos, sin, nh), _rotate(k, cos, sin, nkv)

    return rope


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """RMS norm of each head_dim-wide head of x [T, heads * head_dim] (Gemma 3's q and k norms)."""
    return rms_norm(x.reshape(-1, head_dim), weight, eps).reshape(x.shape)


def gated_act(act: str, *xs: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for silu_mul nodes: act "silu" (Llama) or "gelu_tanh" (Gemma's GeGLU)."""
    if act == "silu":
        return silu_mul(*xs)
    gate, up = xs[0].chunk(2, dim=-1) if len(xs) == 1 else xs
    return F.gelu(gate, approximate="tanh") * up


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] f32, expert ids [T, k]) of a mixture's router logits [T, E]: the softmax over every expert
    (in f32), its k largest, renormalised to sum to 1 with norm_topk_prob (Mixtral, Qwen3-MoE)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(x: torch.Tensor, linear, attrs: dict, act=None, ran=None) -> torch.Tensor:
    """A moe node over x [T, H]: linear(base, h) applies the node's linear `base` ("router",
    "experts.{e}.gate_proj", ..., "shared_expert.down_proj", "shared_expert_gate") to h.

    Each token runs its top_k experts, grouped so that an expert's weights are read once for all the tokens
    routed to it; attrs["experts"] are the experts this node holds (the others' tokens are someone else's: expert
    parallelism sums the ranks' partial outputs). The shared expert, where the node has one, runs on every token,
    scaled by sigmoid of its gate. `act(gate, up)` or `act(gate_up)`: the gated activation of separate or stacked
    projections (default: attrs["act"]'s reference). `ran(e)`, if given, is told each expert that ran."""
    act = act or (lambda *xs: gated_act(attrs["act"], *xs))
    fused = {e["name"] for e in attrs.get("linears", ()) if e["name"].endswith(".gate_up_proj")}

    def mlp(prefix: str, h: torch.Tensor) -> torch.Tensor:
        """An expert's gated MLP: gate and up as one stacked projection (passes/fuse_gate_up.py) or two."""
        if f"{prefix}.gate_up_proj" in fused:
            return linear(f"{prefix}.down_proj", act(linear(f"{prefix}.gate_up_proj", h)))
        return linear(f"{prefix}.down_proj", act(linear(f"{prefix}.gate_proj", h), linear(f"{prefix}.up_proj", h)))

    weights, ids = route(linear("router", x), attrs["top_k"], attrs["norm_topk_prob"])
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)           # (token, slot) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=attrs["num_experts"]).tolist()
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    slot_weights = weights.flatten().to(x.dtype)
    for e in attrs["experts"]:
        if not counts[e]:
            continue
        picked = order[starts[e]:starts[e + 1]]
        rows = picked // attrs["top_k"]
        h = mlp(f"experts.{e}", x.index_select(0, rows))
        out.index_add_(0, rows, h * slot_weights[picked, None])
        if ran is not None:
            ran(e)
    if attrs.get("shared", False):
        out = out + torch.sigmoid(linear("shared_expert_gate", x)) * mlp("shared_expert", x)
    return out


def silu_mul(*xs: torch.Tensor) -> torch.Tensor:
    if len(xs) == 1:
        gate, up = xs[0].chunk(2, dim=-1)
    else:
        gate, up = xs
    return F.silu(gate) * up


def add_rms_norm(x, residual, weight, eps):
    total = x + residual
    return rms_norm(total, weight, eps), total


def split(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.split(x, sizes, dim=-1))


def dense_causal_attention(q, k, v, attrs: dict) -> torch.Tensor:
    """Attention of one sequence with no paged cache: [T, nh*hd]. q holds the last T of the N
    positions in k and v (T == N for a whole prompt, the reference path); attrs["window"] > 0 is a
    sliding window, as the paged kernel's."""
    t, n = q.shape[0], k.shape[0]
    nh, nkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    q = q.reshape(t, nh, hd).transpose(0, 1)
    k = k.reshape(n, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, dim=0)
    v = v.reshape(n, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, dim=0)
    window = attrs.get("window", 0)
    if t == n and not window:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attrs["scale"])
    else:  # query i sits at position n - t + i and sees positions 0..n - t + i (the last `window` of them)
        mask = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        if window:
            mask &= ~torch.ones(t, n, dtype=torch.bool).tril(n - t - window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attrs["scale"])
    return out.transpose(0, 1).reshape(t, nh * hd)
