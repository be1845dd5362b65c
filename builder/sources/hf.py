"""Hugging Face directory source: config.json, safetensors (single or sharded) and tokenizer files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from builder.errors import KilnError
from builder.sources.model import ModelConfig, ModelSpec, canonical_weight_shapes, make_config, write_json

# The Llama decoder: Qwen2 adds biases on q, k and v, Mistral a sliding window, Phi-3 fuses q|k|v and
# gate|up in its checkpoint (split on load) and may scale its rope with LongRoPE.
# Gemma 3's text model (gemma3_text) is the same decoder with the switches of ModelConfig's Gemma fields.
# Mixtures of experts on the same decoder: Mixtral (top-2, renormalised), Qwen2-MoE (a shared expert with a
# sigmoid gate; dense layers by decoder_sparse_step / mlp_only_layers), Qwen3-MoE (q/k norms per head) and OLMoE
# (q/k norms over the whole projection).
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "phi3", "gemma3_text", *MOE_FAMILY)
GEMMA = ("gemma3_text",)
# model_type -> (Kiln module, its checkpoint name) pairs of the MoE block, replaced in that order
MOE_NAMES = {"mixtral": (("mlp.router", "block_sparse_moe.gate"), ("mlp.experts", "block_sparse_moe.experts"),
                         (".gate_proj", ".w1"), (".up_proj", ".w3"), (".down_proj", ".w2")),
             **{family: (("mlp.router", "mlp.gate"),) for family in ("qwen2_moe", "qwen3_moe", "olmoe")}}
# model_type -> {fused checkpoint module: the Kiln modules stacked in its rows, in order}
FUSED_MODULES = {"phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}}
FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def hf_weight_key(name: str, model_type: str = "llama") -> str:
    """The Hugging Face checkpoint key of a Kiln weight name."""
    if name == "lm_head.weight":
        return name
    if ".mlp.router." in name or ".mlp.experts." in name:
        for kiln, theirs in MOE_NAMES.get(model_type, ()):
            name = name.replace(kiln, theirs)
    return f"model.{name}"


def checkpoint_layout(config: ModelConfig, model_type: str) -> dict[str, tuple[str, int, int]]:
    """Kiln weight name -> (checkpoint key, first row, end row) of the rows holding it."""
    shapes = canonical_weight_shapes(config)
    layout = {name: (hf_weight_key(name, model_type), 0, shape[0]) for name, shape in shapes.items()}
    for fused, parts in FUSED_MODULES.get(model_type, {}).items():
        for i in range(config.num_layers):
            row = 0
            for part in parts:
                name = f"layers.{i}.{part}.weight"
                layout[name] = (hf_weight_key(f"layers.{i}.{fused}.weight"), row, row + shapes[name][0])
                row += shapes[name][0]
    return layout


class HFModelSpec(ModelSpec):
    """A Hugging Face model directory; weights are read through safetensors' mmap, one at a time."""

    def __init__(self, name: str, path: Path, config: ModelConfig, tensor_files: dict[str, Path],
                 model_type: str = "llama"):
        super().__init__(name, path, config, list(set(tensor_files.values())))
        self._path = path
        self._tensor_files = tensor_files  # hf key -> shard holding it
        self._layout = checkpoint_layout(config, model_type)
        self._norm_offset = 1.0 if model_type in GEMMA else 0.0  # Gemma's norms scale by 1 + weight

    def _load(self, name: str) -> torch.Tensor:
        key, start, end = self._layout[name]
        with safe_open(self._tensor_files[key], framework="pt") as f:
            rows = f.get_slice(key)
            weight = f.get_tensor(key) if end - start == rows.get_shape()[0] else rows[start:end]
        weight = weight.to(torch.float32)
        if self._norm_offset and name.endswith("norm.weight"):
            weight = weight + self._norm_offset
        return weight

    def write_tokenizer(self, dst_dir: str | Path) -> None:
        dst_dir = Path(dst_dir)
        shutil.copyfile(self._path / "tokenizer.json", dst_dir / "tokenizer.json")
        write_json(dst_dir / "tokenizer_config.json", self._tokenizer_config())
        sampling = _read_optional_json(self._path / "generation_config.json")
        write_json(dst_dir / "generation_config.json", self._generation_config(sampling))

    def _tokenizer_config(self) -> dict:
        config = _read_optional_json(self._path / "tokenizer_config.json")
        config["chat_template"] = _chat_template(self._path, config)
        vocab = _token_strings(_read_json(self._path / "tokenizer.json"))
        defaults = {"bos_token": self.config.bos_token_id,
                    "eos_token": self.config.eos_token_ids[0] if self.config.eos_token_ids else None}
        for role, token_id in defaults.items():
            token = config.get(role)
            if isinstance(token, dict):  # serialized AddedToken
                token = token.get("content")
            if token is None and token_id is not None:
                token = vocab.get(token_id)
            config[role] = token
        return config


def load_hf_dir(path: Path, name: str | None = None) -> HFModelSpec:
    """Open a Hugging Face model directory, checking its config, weights and tokenizer files."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise KilnError(f"model: {path}: no config.json (expected a Hugging Face model directory)")
    hf_config = _read_json(config_path)
    config = config_from_hf(hf_config, _read_optional_json(path / "generation_config.json"), str(path))
    if not (path / "tokenizer.json").is_file():
        raise KilnError(f"model: {path}: no tokenizer.json (a fast tokenizer file is required)")
    tensor_files = _tensor_files(path)
    layout = checkpoint_layout(config, hf_config["model_type"])
    _check_weights(path, layout, config, tensor_files)
    return HFModelSpec(name or path.name, path, config, tensor_files, hf_config["model_type"])


def config_from_hf(hf_config: dict, generation: dict, where: str) -> ModelConfig:
    """Translate a Hugging Face config.json (and generation_config.json) into a ModelConfig."""
    model_type = hf_config.get("model_type")
    if model_type not in LLAMA_FAMILY:
        architectures = ", ".join(hf_config.get("architectures") or []) or "no architectures listed"
        raise KilnError(f"model: {where}: unsupported architecture {model_type!r} ({architectures}); "
                        f"Kiln supports the Llama family: {', '.join(LLAMA_FAMILY)}")
    gemma = model_type in GEMMA
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "silu"
    if {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act) not in ("silu", "gelu_tanh"):
        raise KilnError(f"model: {where}: hidden activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf_config.get(cap) is not None:
            raise KilnError(f"model: {where}: {cap}={hf_config[cap]} is not supported yet")

    def required(key):
        if hf_config.get(key) is None:
            raise KilnError(f"model: {where}: config.json has no {key!r}")
        return hf_config[key]

    num_heads = required("num_attention_heads")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    local_theta = hf_config.get("rope_local_base_freq") or 0.0
    if "full_attention" in rope:  # transformers 5 keeps one set per layer type (Gemma 3)
        local_theta = rope.get("sliding_attention", {}).get("rope_theta") or local_theta
        rope = rope["full_attention"]
    rotary = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor")) or 1.0
    if rotary != 1.0:
        raise KilnError(f"model: {where}: partial rotary embeddings (partial_rotary_factor {rotary}) are not supported")
    rope_theta = hf_config.get("rope_theta") or rope.get("rope_theta") or 10000.0
    moe = _moe_fields(hf_config, model_type, where) if model_type in MOE_FAMILY else {}
    return make_config(
        where,
        architecture="gemma3" if gemma else "llama",
        vocab_size=required("vocab_size"),
        hidden_size=required("hidden_size"),
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or required("hidden_size") // num_heads,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(rope, hf_config),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", gemma)),
        max_position_embeddings=required("max_position_embeddings"),
        attention_bias=bool(hf_config.get("attention_bias", False)),
        qkv_bias=bool(hf_config.get("qkv_bias", model_type in ("qwen2", "qwen2_moe"))),
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf_config.get("eos_token_id"), generation.get("eos_token_id")),
        layer_windows=layer_windows(hf_config, where),
        hidden_act="gelu_tanh" if act == "gelu_pytorch_tanh" else act,
        qk_norm=gemma or model_type in ("qwen3_moe", "olmoe"),
        sandwich_norms=gemma,
        embedding_scale=float(np.float32(required("hidden_size") ** 0.5)) if gemma else 1.0,
        attention_scale=float(required("query_pre_attn_scalar")) ** -0.5 if gemma else 0.0,
        local_rope_theta=float(local_theta) if gemma else 0.0,
        **moe,
    )


def _moe_fields(hf_config: dict, model_type: str, where: str) -> dict:
    """The ModelConfig fields of a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    if hf_config.get("clip_qkv") is not None:
        raise KilnError(f"model: {where}: clip_qkv={hf_config['clip_qkv']} (OLMoE's clamped q, k and v) "
                        "is not supported")
    experts = hf_config.get("num_local_experts") or hf_config.get("num_experts")
    top_k = hf_config.get("num_experts_per_tok")
    if not experts or not top_k:
        raise KilnError(f"model: {where}: a {model_type} config needs num_experts and num_experts_per_tok")
    layers = hf_config["num_hidden_layers"]
    step = hf_config.get("decoder_sparse_step") or 1
    dense = set(hf_config.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not moe_layers:
        raise KilnError(f"model: {where}: no layer is a mixture (decoder_sparse_step {step}, mlp_only_layers "
                        f"{sorted(dense)})")
    intermediate = hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]
    shared = hf_config.get("shared_expert_intermediate_size") or 0 if model_type == "qwen2_moe" else 0
    return dict(num_experts=int(experts), experts_per_token=int(top_k), expert_intermediate_size=int(intermediate),
                norm_topk_prob=True if model_type == "mixtral" else bool(hf_config.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(shared), moe_layers=moe_layers,
                qk_norm_full=model_type == "olmoe")


def layer_windows(hf_config: dict, where: str) -> tuple[int, ...]:
    """Each layer's sliding window (0 = full attention), from `layer_types` where the config lists them
    (transformers 5, Gemma 3), else `sliding_window` on every layer (Mistral) unless
    `use_sliding_window` is false (Qwen2 records a window it does not use)."""
    window = hf_config.get("sliding_window")
    if not hf_config.get("use_sliding_window", True):
        window = None
    layers = hf_config.get("num_hidden_layers") or 0
    types = hf_config.get("layer_types")
    if types is None:
        return (int(window),) * layers if window else ()
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise KilnError(f"model: {where}: layer_types {', '.join(map(repr, unknown))} are not supported "
                        "(full_attention, sliding_attention)")
    if "sliding_attention" in types and not window:
        raise KilnError(f"model: {where}: layer_types has sliding_attention layers but no sliding_window")
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in types)


def _rope_scaling(rope: dict, hf_config: dict) -> dict | None:
    """Normalise rope_scaling (transformers 4) or rope_parameters (transformers 5); None for plain rope.

    LongRoPE (Phi-3) gets its attention factor here, as transformers derives it: from `factor`, else
    the ratio of max_position_embeddings to original_max_position_embeddings."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type == "default":
        return None
    scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items()
               if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        original = scaling.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
        if original:
            scaling["original_max_position_embeddings"] = original
            factor = scaling.pop("factor", None) or hf_config["max_position_embeddings"] / original
            if scaling.get("attention_factor") is None:
                scaling["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return scaling


def _eos_ids(*sources) -> tuple[int, ...]:
    ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map each checkpoint key to its safetensors file, validating every file's header."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise KilnError(f"model: {index_path}: no weight_map (corrupt safetensors index)")
        listed = {key: path / shard for key, shard in weight_map.items()}
    elif (path / SINGLE_FILE).is_file():
        listed = None
    else:
        raise KilnError(f"model: {path}: no {SINGLE_FILE} or {INDEX_FILE} "
                        "(only safetensors weights are supported)")
    files = {}
    for shard in sorted(set(listed.values())) if listed is not None else [path / SINGLE_FILE]:
        if not shard.is_file():
            raise KilnError(f"model: {shard}: missing (listed in {INDEX_FILE})")
        files.update({key: shard for key in _safetensors_keys(shard)})
    if listed is None:
        return files
    absent = sorted(key for key, shard in listed.items() if files.get(key) != shard)
    if absent:
        raise KilnError(f"model: {listed[absent[0]]}: lacks {absent[0]} (listed in {INDEX_FILE})")
    return listed


def _safetensors_keys(shard: Path) -> set[str]:
    try:
        with safe_open(shard, framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise KilnError(f"model: {shard}: corrupt or truncated safetensors file ({e})") from None


def _check_weights(path: Path, layout: dict, config: ModelConfig, tensor_files: dict[str, Path]) -> None:
    """Every weight the config implies is present, with that shape and a float dtype."""
    expected = {}
    for name, shape in canonical_weight_shapes(config).items():
        key, _, end = layout[name]
        expected[key] = (max(end, expected.get(key, (0,))[0]), *shape[1:])
    missing = sorted(set(expected) - set(tensor_files))
    if missing:
        raise KilnError(f"model: {path}: weight {missing[0]} is missing (config.json expects it)")
    for shard in sorted({tensor_files[key] for key in expected}):
        with safe_open(shard, framework="pt") as f:
            for key in sorted(k for k in expected if tensor_files[k] == shard):
                info = f.get_slice(key)
                shape, dtype = tuple(info.get_shape()), info.get_dtype()
                if shape != expected[key]:
                    raise KilnError(f"model: {shard}: {key} has shape {list(shape)}, "
                                    f"config.json implies {list(expected[key])}")
                if dtype not in FLOAT_DTYPES:
                    raise KilnError(f"model: {shard}: {key} has dtype {dtype} "
                                    f"(supported: {', '.join(FLOAT_DTYPES)})")


def _chat_template(path: Path, tokenizer_config: dict):
    """The chat template from tokenizer_config.json, or from chat_template.jinja / .json beside it."""
    if tokenizer_config.get("chat_template"):
        return tokenizer_config["chat_template"]
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").is_file():
        return _read_json(path / "chat_template.json").get("chat_template")
    return None


def _token_strings(tokenizer: dict) -> dict[int, str]:
    """id -> token string from a tokenizer.json (model vocab plus added tokens)."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    strings = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
    strings.update({t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])})
    return strings


def _read_optional_json(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KilnError(f"model: {path}: unreadable JSON ({e})") from None
