"""Leaf functions of the reference modules: each call becomes one IR node when traced with torch.fx.

Every leaf takes its activations and weights as tensors and its attributes as keyword constants,
plus `name=` (the node's name). Run eagerly they compute the op densely (one whole sequence).
"""

from __future__ import annotations

import torch.nn.functional as F

from runtime.ops import reference


def embedding(tokens, weight, *, name: str, hidden_size: int, vocab_size: int, scale: float = 1.0):
    rows = F.embedding(tokens, weight)
    return rows * scale if scale != 1.0 else rows


def rms_norm(x, weight, *, name: str, eps: float):
    return reference.rms_norm(x, weight, eps)


def linear(x, weight, bias=None, *, name: str, in_features: int, out_features: int):
    return F.linear(x, weight, bias)


def rope(q, k, positions, *, name: str, head_dim: int, num_heads: int, num_kv_heads: int,
         theta: float, scaling: dict | None):
    attrs = dict(head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, theta=theta,
                 scaling=scaling)
    return reference.make_rope(attrs)(q, k, positions)


def attention(q, k, v, *, name: str, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
              scale: float, window: int = 0):
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, window=window)
    return reference.dense_causal_attention(q, k, v, attrs)


def head_rms_norm(x, weight, *, name: str, eps: float, head_dim: int):
    return reference.head_rms_norm(x, weight, eps, head_dim)


def silu_mul(gate, up, *, name: str, act: str = "silu"):
    return reference.gated_act(act, gate, up)


def add(a, b, *, name: str):
    return a + b


def gather_last(x, *, name: str):
    return x[-1:]


def logits(x, weight, *, name: str, in_features: int, out_features: int):
    return F.linear(x, weight).float()


def moe(x, *weights, name: str, num_experts: int, top_k: int, norm_topk_prob: bool, act: str, experts: list,
        shared: bool, linears: list):
    """A mixture-of-experts MLP; `weights` are those of `linears` ({name, in_features, out_features} each: the
    router, each expert's gate/up/down projections, the shared expert's and its gate) in that order."""
    attrs = dict(num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob, act=act, experts=experts,
                 shared=shared)
    named = {linear["name"]: weight for linear, weight in zip(linears, weights)}
    return reference.moe(x, lambda base, h: F.linear(h, named[base]), attrs)


LEAVES = {f.__name__: f for f in (embedding, rms_norm, head_rms_norm, linear, rope, attention, silu_mul, add,
                                   gather_last, logits, moe)}
