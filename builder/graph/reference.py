"""Reference torch module of the Llama family, written only with the leaf functions of builder.graph.ops.

The same decoder serves Gemma 3 through its config's switches: q/k head norms, norms after attention
and the MLP (sandwich_norms), the gelu-tanh gate, scaled embeddings, per-layer windows and rope bases.

Parameters live on the meta device while tracing: the trace needs names and shapes, never data.
Module paths equal the canonical weight names (`layers.3.self_attn.q_proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from builder.graph.ops import (add, attention, embedding, gather_last, head_rms_norm, linear, logits, moe, rms_norm, rope,
                         silu_mul)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, path: str, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.path, self.in_features, self.out_features = path, in_features, out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias, name=self.path,
                      in_features=self.in_features, out_features=self.out_features)


class RMSNorm(nn.Module):
    def __init__(self, path: str, size: int, eps: float):
        super().__init__()
        self.path, self.eps = path, eps
        self.weight = _param(size)

    def forward(self, x):
        return rms_norm(x, self.weight, name=self.path, eps=self.eps)


class HeadRMSNorm(nn.Module):
    def __init__(self, path: str, head_dim: int, eps: float):
        super().__init__()
        self.path, self.eps, self.head_dim = path, eps, head_dim
        self.weight = _param(head_dim)

    def forward(self, x):
        return head_rms_norm(x, self.weight, name=self.path, eps=self.eps, head_dim=self.head_dim)


class Attention(nn.Module):
    def __init__(self, path: str, layer: int, cfg):
        super().__init__()
        self.path, self.layer, self.cfg = path, layer, cfg
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = Linear(f"{path}.q_proj", cfg.hidden_size, q_width, bias)
        self.k_proj = Linear(f"{path}.k_proj", cfg.hidden_size, kv_width, bias)
        self.v_proj = Linear(f"{path}.v_proj", cfg.hidden_size, kv_width, bias)
        self.o_proj = Linear(f"{path}.o_proj", q_width, cfg.hidden_size, cfg.attention_bias)
        if cfg.qk_norm_full:  # OLMoE: one norm over all of q's heads, one over k's
            self.q_norm = RMSNorm(f"{path}.q_norm", q_width, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(f"{path}.k_norm", kv_width, cfg.rms_norm_eps)
        elif cfg.qk_norm:
            self.q_norm = HeadRMSNorm(f"{path}.q_norm", cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = HeadRMSNorm(f"{path}.k_norm", cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions):
        cfg = self.cfg
        q, k = self.q_proj(x), self.k_proj(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        theta, scaling = cfg.rope_of(self.layer)
        q, k = rope(q, k, positions, name=f"{self.path}.rope",
                    head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                    theta=theta, scaling=scaling)
        window = cfg.window(self.layer)
        out = attention(q, k, self.v_proj(x), name=f"{self.path}.attn", layer=self.layer,
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, scale=cfg.softmax_scale(), **({"window": window} if window else {}))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, path: str, cfg):
        super().__init__()
        self.path, self.act = path, cfg.hidden_act
        bias = cfg.mlp_bias
        self.gate_proj = Linear(f"{path}.gate_proj", cfg.hidden_size, cfg.intermediate_size, bias)
        self.up_proj = Linear(f"{path}.up_proj", cfg.hidden_size, cfg.intermediate_size, bias)
        self.down_proj = Linear(f"{path}.down_proj", cfg.intermediate_size, cfg.hidden_size, bias)

    def forward(self, x):
        act = {"act": self.act} if self.act != "silu" else {}
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x), name=f"{self.path}.act", **act))


class Weight(nn.Module):
    """A module holding one projection weight [out, in] (a linear inside a moe node)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = Weight(inter, hidden), Weight(inter, hidden)
        self.down_proj = Weight(hidden, inter)


class MoE(nn.Module):
    """A mixture of experts, one moe node: the router, the experts' gated MLPs and the shared expert (if any)."""

    def __init__(self, path: str, cfg):
        super().__init__()
        self.path, self.cfg = path, cfg
        hidden, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.router = Weight(cfg.num_experts, hidden)
        self.experts = nn.ModuleList(GatedMLP(hidden, cfg.expert_intermediate_size) for _ in range(cfg.num_experts))
        if shared:
            self.shared_expert = GatedMLP(hidden, shared)
            self.shared_expert_gate = Weight(1, hidden)

    def forward(self, x):
        cfg = self.cfg
        named = [(name.removesuffix(".weight"), p) for name, p in self.named_parameters()]
        linears = [{"name": name, "out_features": p.shape[0], "in_features": p.shape[1]} for name, p in named]
        return moe(x, *[p for _, p in named], name=self.path, num_experts=cfg.num_experts,
                   top_k=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob, act=cfg.hidden_act,
                   experts=list(range(cfg.num_experts)), shared=bool(cfg.shared_expert_intermediate_size),
                   linears=linears)


class DecoderLayer(nn.Module):
    def __init__(self, index: int, cfg):
        super().__init__()
        self.path = path = f"layers.{index}"
        self.input_layernorm = RMSNorm(f"{path}.input_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(f"{path}.self_attn", index, cfg)
        self.post_attention_layernorm = RMSNorm(f"{path}.post_attention_layernorm", cfg.hidden_size,
                                                cfg.rms_norm_eps)
        self.mlp = MoE(f"{path}.mlp", cfg) if cfg.is_moe(index) else MLP(f"{path}.mlp", cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(f"{path}.pre_feedforward_layernorm", cfg.hidden_size,
                                                     cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(f"{path}.post_feedforward_layernorm", cfg.hidden_size,
                                                      cfg.rms_norm_eps)

    def forward(self, h, positions):
        if self.sandwich:  # Gemma: norm, block, norm, then the residual
            attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), positions))
            h = add(h, attn, name=f"{self.path}.attn_residual")
            mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
            return add(h, mlp, name=f"{self.path}.mlp_residual")
        h = add(h, self.self_attn(self.input_layernorm(h), positions), name=f"{self.path}.attn_residual")
        return add(h, self.mlp(self.post_attention_layernorm(h)), name=f"{self.path}.mlp_residual")


class LlamaReference(nn.Module):
    """tokens [T], positions [T] -> logits [N, vocab] for the last token of the sequence."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(i, cfg) for i in range(cfg.num_layers))
        self.norm = RMSNorm("norm", cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(cfg.vocab_size, cfg.hidden_size)

    def forward(self, tokens, positions):
        cfg = self.cfg
        scale = {"scale": cfg.embedding_scale} if cfg.embedding_scale != 1.0 else {}
        h = embedding(tokens, self.embed_tokens.weight, name="embed_tokens",
                      hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, **scale)
        for layer in self.layers:
            h = layer(h, positions)
        h = self.norm(gather_last(h, name="gather_last"))
        head = self.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        return logits(h, head, name="lm_head", in_features=cfg.hidden_size, out_features=cfg.vocab_size)


ARCHITECTURES = {"llama": LlamaReference, "gemma3": LlamaReference}
