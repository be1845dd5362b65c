"""Write a loaded model as a GGUF file the way llama.cpp's converter lays it out, for the source tests.

`types` picks each weight's GGUF type by name pattern: F32, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are
quantized from the model's weights by the `gguf` package; the K-quants (Q2_K, Q4_K, Q5_K, Q6_K), which
it cannot quantize, are written as seeded random blocks with small scales. Either way the file's dequantized
values, not the source model's, are what a test compares against.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import gguf
import numpy as np

from builder.sources.gguf_source import EXPERT_STACKS, GLOBAL_NAMES, layer_names


def gguf_name(name: str, architecture: str = "llama") -> str:
    """The llama.cpp tensor name of a Kiln weight name (the inverse of builder.sources.gguf_source.canonical_name)."""
    by_kiln = {kiln: g for g, kiln in GLOBAL_NAMES.items()}
    if name in by_kiln:
        return by_kiln[name]
    _, layer, *module, kind = name.split(".")
    by_module = {kiln: g for g, kiln in layer_names(architecture).items()}
    return f"blk.{layer}.{by_module['.'.join(module)]}.{kind}"


def random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes] of valid K-quant blocks with values of about +-0.2.

    Sub-block scales and mins are kept below 8 and dmin is chosen so that the values centre on zero.
    """
    qtype = gguf.GGMLQuantizationType[kind]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)

    def f16(value: float) -> np.ndarray:
        return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    if kind in ("Q4_K", "Q5_K"):
        d, levels = 2e-3, (15 if kind == "Q4_K" else 31)
        blocks[..., 0:2] = f16(d)
        blocks[..., 2:4] = f16(d * levels / 2)         # dmin: m (mean 3.5) x dmin ~ sc x q's mean
        blocks[..., 4:12] &= 0x07                      # low bits of sc and m: 0..7
        blocks[..., 12:16] &= 0x00                     # no high bits
    elif kind == "Q6_K":
        blocks[..., 192:208] = (blocks[..., 192:208].view(np.int8) % 9 - 4).view(np.uint8)  # scales -4..4
        blocks[..., 208:210] = f16(2e-3)
    elif kind == "Q2_K":  # 16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit codes, d, dmin
        d = 2e-3
        blocks[..., 80:82] = f16(d)
        blocks[..., 82:84] = f16(d * 1.5)  # dmin: m's mean (7.5) x dmin ~ sc's mean x q's mean (1.5) x d
    else:
        raise ValueError(f"random_k_blocks: {kind} is not a K-quant")
    return blocks.reshape(rows, -1)


def write_gguf(path, spec, architecture: str = "llama", types: dict[str, str] | None = None,
               tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Convert a loaded model to a GGUF file; llama's q/k rows are permuted for its rope as llama.cpp does.

    `types`: {glob over llama.cpp tensor names: GGUF type}, first match wins, default F32 (1-D weights
    are always F32). `tokenizer_dir`: a directory with tokenizer.json and tokenizer_config.json to embed.
    """
    config, rng = spec.config, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    if config.layer_windows and architecture in ("gemma3", "phi3"):
        writer.add_sliding_window(max(config.layer_windows))  # gemma3's layer pattern is llama.cpp's fixed one
    if architecture in ("gemma3", "qwen3moe"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.num_experts:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.experts_per_token)
        writer.add_expert_feed_forward_length(config.expert_intermediate_size)
        if config.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    scaling = config.rope_scaling or {}
    if architecture == "phi3" and scaling.get("rope_type") == "longrope":  # the factors as tensors, as llama.cpp
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        for key in ("long", "short"):
            writer.add_tensor(f"rope_factors_{key}.weight", np.array(scaling[f"{key}_factor"], dtype=np.float32))
    if tokenizer_dir is not None:
        _add_tokenizer(writer, Path(tokenizer_dir))
    for name, weight in _stored_weights(spec, architecture):
        kind = next((t for pattern, t in (types or {}).items() if fnmatchcase(name, pattern)), "F32")
        if weight.ndim == 1 or kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(weight))
        elif kind.endswith("_K"):  # a stack of experts [E, rows, cols]: E * rows rows of blocks
            blocks = random_k_blocks(kind, int(np.prod(weight.shape[:-1])), weight.shape[-1], rng)
            writer.add_tensor(name, blocks.reshape(*weight.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(weight), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _stored_weights(spec, architecture: str):
    """(llama.cpp tensor name, array) of every weight as the converter stores it: llama's q/k rows
    interleaved for its rope, Phi-3's q|k|v and gate|up fused into attn_qkv and ffn_up, a mixture's experts
    stacked by projection (ffn_gate_exps [E, I, H], ...)."""
    config, fused, stacks = spec.config, {}, {}
    stack_of = {proj: stack for stack, proj in EXPERT_STACKS.items()}
    for name in spec.weight_names():
        weight = spec.load(name).numpy()
        parts = name.split(".")
        if name.endswith("mlp.shared_expert_gate.weight"):  # [1, H] is stored as [H]
            weight = weight.reshape(-1)
        if parts[2:4] == ["mlp", "experts"]:  # layers.L.mlp.experts.E.PROJ.weight
            stacks.setdefault(f"blk.{parts[1]}.{stack_of[parts[5]]}.weight", {})[int(parts[4])] = weight
            continue
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if heads and architecture == "llama":
            weight = weight.reshape(heads, 2, -1, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
        stored = gguf_name(name, architecture)
        part = stored.split(".")[-2]
        if architecture == "phi3" and part in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            whole = stored.replace(part, "attn_qkv" if part.startswith("attn") else "ffn_up")
            fused.setdefault(whole, {})[part] = weight
            continue
        yield stored, weight
    order = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    for whole, parts in fused.items():
        yield whole, np.concatenate([parts[p] for p in order if p in parts])
    for stack, experts in stacks.items():
        yield stack, np.stack([experts[e] for e in range(len(experts))])


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer metadata, with its chat template."""
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tokenizer["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair
                             for pair in tokenizer["model"]["merges"]])
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])
