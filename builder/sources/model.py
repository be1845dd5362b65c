"""What every model source yields: a ModelConfig and a ModelSpec with lazily loaded weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from builder.errors import KilnError
from runtime.format.special_tokens import SpecialTokens, from_tokenizer

# rope scaling types Kiln implements -> the parameters each needs
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
    "linear": ("factor",),
}
ARCHITECTURES = ("llama", "gemma3")  # the Llama decoder, and it with Gemma 3's norms and activations
HIDDEN_ACTS = ("silu", "gelu_tanh")
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a Llama-family decoder, independent of the source format."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False   # q, k, v and o projections have biases
    mlp_bias: bool = False
    qkv_bias: bool = False         # q, k and v only (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_windows: tuple[int, ...] = ()  # sliding window of each layer (0 = full attention); () = all full
    # Gemma 3: a gelu-tanh gate, RMS norms on each q and k head, norms after attention and the MLP as well
    # as before, embeddings scaled by sqrt(hidden), its own softmax scale, and a rope base of its own
    # for the sliding-window layers (rope_scaling applies to the full-attention layers only).
    hidden_act: str = "silu"
    qk_norm: bool = False
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    attention_scale: float = 0.0      # 0: head_dim ** -0.5
    local_rope_theta: float = 0.0     # 0: rope_theta on every layer
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the MLP of each layer in moe_layers is a router
    # over num_experts gated MLPs of expert_intermediate_size, of which a token runs experts_per_token, weighted
    # by the router's softmax (renormalised over the chosen ones with norm_topk_prob), plus, with
    # shared_expert_intermediate_size, one MLP every token runs, scaled by sigmoid of its own gate (Qwen2-MoE).
    num_experts: int = 0               # 0: a dense model
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()   # the layers whose MLP is a mixture (() with experts: every layer)
    qk_norm_full: bool = False         # q and k norms over the whole projection (OLMoE), not per head

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not supported ({', '.join(ARCHITECTURES)})")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field}: expected a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_SCALING_KEYS:
                raise ValueError(f"rope_scaling: type {rope_type!r} is not supported "
                                 f"(supported: {', '.join(ROPE_SCALING_KEYS)})")
            missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling: {rope_type} scaling lacks {', '.join(missing)}")
            if rope_type == "longrope":
                for key in ("short_factor", "long_factor"):
                    if len(self.rope_scaling[key]) != self.head_dim // 2:
                        raise ValueError(f"rope_scaling: {key} has {len(self.rope_scaling[key])} entries, "
                                         f"head_dim {self.head_dim} needs {self.head_dim // 2}")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows: expected {self.num_layers} windows >= 0 (one per layer), "
                             f"got {list(self.layer_windows)}")
        if not any(self.layer_windows):
            object.__setattr__(self, "layer_windows", ())
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token: expected 1..{self.num_experts} (num_experts), "
                                 f"got {self.experts_per_token}")
            if self.expert_intermediate_size <= 0:
                raise ValueError(f"expert_intermediate_size: expected a positive integer, "
                                 f"got {self.expert_intermediate_size}")
            if not self.moe_layers:
                object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers: {list(self.moe_layers)} are not all layers of {self.num_layers}")
        elif self.moe_layers or self.shared_expert_intermediate_size:
            raise ValueError("moe_layers and shared_expert_intermediate_size need num_experts > 0")

    def window(self, layer: int) -> int:
        """The sliding window of `layer`: a query sees its last `window` positions; 0 = all of them."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_of(self, layer: int) -> tuple[float, dict | None]:
        """(theta, scaling) of `layer`'s rotary embedding: Gemma 3's sliding layers have a base of their own."""
        if self.local_rope_theta and self.window(layer):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def is_moe(self, layer: int) -> bool:
        """`layer`'s MLP is a mixture of experts."""
        return layer in self.moe_layers

    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim ** -0.5

    def to_dict(self) -> dict:
        config = dataclasses.asdict(self)
        config["eos_token_ids"] = list(self.eos_token_ids)
        config["layer_windows"] = list(self.layer_windows)
        config["moe_layers"] = list(self.moe_layers)
        return config

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"model config: unknown fields {', '.join(unknown)}")
        return cls(**{**config, "eos_token_ids": tuple(config.get("eos_token_ids", ())),
                      "layer_windows": tuple(config.get("layer_windows", ())),
                      "moe_layers": tuple(config.get("moe_layers", ()))})


def canonical_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Kiln weight names mapped to their shapes ([out, in] for projections, as in Hugging Face)."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    qkv_bias = config.attention_bias or config.qkv_bias
    projections = {
        "self_attn.q_proj": (q_out, hidden, qkv_bias),
        "self_attn.k_proj": (kv_out, hidden, qkv_bias),
        "self_attn.v_proj": (kv_out, hidden, qkv_bias),
        "self_attn.o_proj": (hidden, q_out, config.attention_bias),
        "mlp.gate_proj": (inter, hidden, config.mlp_bias),
        "mlp.up_proj": (inter, hidden, config.mlp_bias),
        "mlp.down_proj": (hidden, inter, config.mlp_bias),
    }
    for i in range(config.num_layers):
        shapes.update(_mlp_shapes(config, i))
        shapes[f"layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"layers.{i}.post_attention_layernorm.weight"] = (hidden,)
        if config.sandwich_norms:  # Gemma: post_attention_layernorm follows attention; these wrap the MLP
            shapes[f"layers.{i}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"layers.{i}.post_feedforward_layernorm.weight"] = (hidden,)
        if config.qk_norm:
            q_norm, k_norm = (q_out, kv_out) if config.qk_norm_full else (head_dim, head_dim)
            shapes[f"layers.{i}.self_attn.q_norm.weight"] = (q_norm,)
            shapes[f"layers.{i}.self_attn.k_norm.weight"] = (k_norm,)
        for proj, (out_features, in_features, has_bias) in projections.items():
            if proj.startswith("mlp.") and config.is_moe(i):
                continue
            shapes[f"layers.{i}.{proj}.weight"] = (out_features, in_features)
            if has_bias:
                shapes[f"layers.{i}.{proj}.bias"] = (out_features,)
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A mixture layer's router, experts and shared expert (a dense layer's MLP is among the projections)."""
    if not config.is_moe(layer):
        return {}
    hidden, inter, prefix = config.hidden_size, config.expert_intermediate_size, f"layers.{layer}.mlp"
    shapes = {f"{prefix}.router.weight": (config.num_experts, hidden)}
    experts = [f"experts.{e}" for e in range(config.num_experts)]
    shared = config.shared_expert_intermediate_size
    for mlp, size in [(e, inter) for e in experts] + ([("shared_expert", shared)] if shared else []):
        shapes[f"{prefix}.{mlp}.gate_proj.weight"] = (size, hidden)
        shapes[f"{prefix}.{mlp}.up_proj.weight"] = (size, hidden)
        shapes[f"{prefix}.{mlp}.down_proj.weight"] = (hidden, size)
    if shared:
        shapes[f"{prefix}.shared_expert_gate.weight"] = (1, hidden)
    return shapes


class RawBlocks(NamedTuple):
    """A weight in its source's native quantized form: ggml type name, block bytes [N, row_bytes], [N, K]."""

    ggml_type: str
    data: np.ndarray
    shape: tuple[int, int]


class ModelSpec:
    """A loaded model source: config, identity and weights read one tensor at a time.

    Subclasses (one per source format) implement `_load`, `write_tokenizer` and, where the
    source holds quantized blocks, `raw_blocks`.
    """

    def __init__(self, name: str, source: Path, config: ModelConfig, weight_files: list[Path]):
        self.name = name
        self.source = str(source)
        self.config = config
        self.weight_files = sorted(weight_files)
        self._shapes = canonical_weight_shapes(config)
        self._sha256: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, source={self.source!r})"

    def weight_names(self) -> list[str]:
        return sorted(self._shapes)

    def weight_shape(self, name: str) -> tuple[int, ...]:
        self._check_name(name)
        return self._shapes[name]

    def load(self, name: str) -> torch.Tensor:
        """The weight `name` as a new float32 tensor in Hugging Face layout."""
        self._check_name(name)
        return self._load(name)

    def raw_blocks(self, name: str) -> RawBlocks | None:
        """The source's quantized blocks of `name` where they have an exact Kiln format (GGUF Q4_0, Q4_1,
        Q4_K, Q8_0), else None."""
        self._check_name(name)
        return None

    def stored_type(self, name: str) -> str | None:
        """The GGUF type `name` is stored in ("Q6_K", "F16", ...), or None for a float checkpoint."""
        self._check_name(name)
        return None

    def weights_sha256(self) -> str:
        """sha256 over the bytes of the weight files in sorted path order (streamed, cached)."""
        if self._sha256 is None:
            digest = hashlib.sha256()
            for path in self.weight_files:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
            self._sha256 = digest.hexdigest()
        return self._sha256

    def write_tokenizer(self, dst_dir: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json into dst_dir."""
        raise NotImplementedError

    def special_tokens(self, tokenizer_config: dict, tokenizer) -> SpecialTokens:
        """The special tokens a raw text gets (BOS), from the tokenizer files write_tokenizer wrote."""
        return from_tokenizer(tokenizer_config, tokenizer)

    def _load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _check_name(self, name: str) -> None:
        if name not in self._shapes:
            raise KeyError(f"{name!r} is not a weight of {self.name} (see ModelSpec.weight_names())")

    def _generation_config(self, sampling: dict) -> dict:
        config = {"eos_token_id": list(self.config.eos_token_ids)}
        if self.config.bos_token_id is not None:
            config["bos_token_id"] = self.config.bos_token_id
        config.update({k: sampling[k] for k in SAMPLING_KEYS if sampling.get(k) is not None})
        return config


def write_json(path: Path, obj) -> None:
    """Write JSON with sorted keys and a fixed layout, so equal content gives equal bytes."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_config(where: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), with a validation failure reported as a one-line KilnError."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise KilnError(f"model: {where}: {e}") from None
