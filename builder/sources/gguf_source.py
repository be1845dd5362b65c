"""GGUF source: a .gguf file of the llama, qwen2, phi3, gemma3, qwen2moe or qwen3moe architecture, dequantized on
load, its tokenizer rebuilt from its metadata. Mixtures of experts keep llama.cpp's layout: each layer's experts
stacked in one tensor per projection (ffn_gate_exps [E, I, H], ffn_up_exps, ffn_down_exps [E, H, I]), read one
expert at a time; a llama file with expert_count is Mixtral.

Weights whose blocks have an exact Kiln format (builder/sources/gguf_blocks.py: Q4_0, Q4_1 and Q4_K as int4;
Q5_0, Q5_1 and Q5_K as int5; Q6_K as int6; Q8_0 as int8) keep them bit for bit under `[quant] method =
"source"`; other quantized blocks (Q2_K, Q3_K, the IQ types, ...) are dequantized and, under "source",
requantized to int8 group-32, with the build's accuracy measured.
"""

from __future__ import annotations

import functools
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from builder.errors import KilnError
from builder.sources.gguf_blocks import BLOCK_FORMATS
from builder.sources.model import ModelConfig, ModelSpec, RawBlocks, canonical_weight_shapes, make_config, write_json
from runtime.format.special_tokens import SpecialTokens, from_flags

GGUF_MAGIC = b"GGUF"
DEQUANT_CHUNK = 1 << 22  # elements dequantized at a time when loading a weight
FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF architecture -> whether llama.cpp's converter interleaved the q/k rows for its rope (llama
# does; qwen2 keeps Hugging Face's order). Metadata keys are prefixed with the architecture name.
ARCHITECTURES = {"llama": True, "qwen2": False, "gemma3": False, "phi3": False, "qwen2moe": False, "qwen3moe": False}
# a mixture's tensors: the router, the shared expert and its gate; the stacked experts are EXPERT_STACKS
MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.router", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3: llama.cpp's ffn_norm is the norm before the MLP, post_attention_norm the one after attention
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3: llama.cpp keeps the checkpoint's fused tensors (q|k|v rows; gate|up rows in ffn_up)
PHI3_FUSED = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's gemma3: every sixth layer attends globally, the rest in the window
GEMMA3_LOCAL_THETA = 10000.0  # the rope base of its sliding layers, fixed by llama.cpp (not in the file)
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
SPECIAL_TOKEN_METADATA = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
SAMPLING_METADATA = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                     "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}


def layer_names(architecture: str) -> dict[str, str]:
    """llama.cpp's per-layer tensor names of a GGUF architecture -> Kiln's module paths (a mixture's stacked
    experts aside: EXPERT_STACKS)."""
    if architecture == "gemma3":
        return GEMMA_LAYER_NAMES
    return {**LAYER_NAMES, **MOE_LAYER_NAMES, **(QK_NORM_NAMES if architecture == "qwen3moe" else {})}


def canonical_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Kiln weight name of a llama.cpp tensor name, or None if it has no counterpart."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match, names = LAYER_TENSOR.fullmatch(gguf_name), layer_names(architecture)
    if match is None or match[2] not in names:
        return None
    return f"layers.{match[1]}.{names[match[2]]}.{match[3]}"


class GGUFModelSpec(ModelSpec):
    """A llama-architecture GGUF file, memory-mapped; each weight dequantized when it is loaded."""

    def __init__(self, name: str, path: Path, config: ModelConfig, reader: GGUFReader, tensors: dict,
                 architecture: str = "llama"):
        super().__init__(name, path, config, [path])
        self.gguf_architecture = architecture  # the GGUF's general.architecture
        self._path = path
        self._reader = reader
        self._tensors = tensors  # Kiln name -> (gguf ReaderTensor, its first row for this weight)

    @property
    def stored_tensors(self) -> list:
        """The file's tensors as it stores them (gguf ReaderTensors: name, type, element and byte counts)."""
        return self._reader.tensors

    def _rows(self, name: str) -> np.ndarray:
        """The stored rows of `name` ([rows, row bytes or values]): a row range of a fused tensor (Phi-3)."""
        tensor, first = self._tensors[name]
        stored_rows = math.prod(int(n) for n in tensor.shape[1:])  # ggml lists dims innermost first; experts stack
        return tensor.data.reshape(stored_rows, -1)[first:first + self.weight_shape(name)[0]]

    def _load(self, name: str) -> torch.Tensor:
        (tensor, _), shape = self._tensors[name], self.weight_shape(name)
        if len(shape) == 1:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            # a copy: the file is mapped read-only
            return torch.from_numpy(np.array(self._unpermute(name, values), dtype=np.float32))
        # Row chunks into one float32 array: dequantizing a whole embedding at once needs several
        # temporaries of its float size, the largest share of a streaming build's peak memory.
        blocks = self._rows(name)
        values = np.empty(shape, dtype=np.float32)
        step = max(1, DEQUANT_CHUNK // shape[1])
        for start in range(0, shape[0], step):
            rows = dequantize(blocks[start:start + step], tensor.tensor_type)
            values[start:start + step] = rows.reshape(-1, shape[1])
        return torch.from_numpy(np.ascontiguousarray(self._unpermute(name, values)))

    def stored_type(self, name: str) -> str:
        self._check_name(name)
        return self._tensors[name][0].tensor_type.name

    def raw_blocks(self, name: str) -> RawBlocks | None:
        self._check_name(name)
        tensor, _ = self._tensors[name]
        if tensor.tensor_type.name not in BLOCK_FORMATS:
            return None
        data = np.array(self._unpermute(name, self._rows(name)))
        return RawBlocks(tensor.tensor_type.name, data, self.weight_shape(name))

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's q/k row order (rotary pairs interleaved) back to Hugging Face's (halves).

        The converter stores row h*hd + 2*i + j of HF row h*hd + j*hd/2 + i; this is transformers'
        LlamaTensorProcessor._reverse_permute_weights. It moves whole rows, so it applies to block bytes
        (and biases) too. Architectures whose converter keeps Hugging Face's order are left alone.
        """
        if not ARCHITECTURES[self.gguf_architecture]:
            return rows
        if ".q_proj." in name:
            num_heads = self.config.num_heads
        elif ".k_proj." in name:
            num_heads = self.config.num_kv_heads
        else:
            return rows
        head_pairs = rows.shape[0] // num_heads // 2
        return rows.reshape(num_heads, head_pairs, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def write_tokenizer(self, dst_dir: str | Path) -> None:
        dst_dir = Path(dst_dir)
        tokens = _field(self._reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise KilnError(f"model: {self._path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
        stat = self._path.stat()
        (dst_dir / "tokenizer.json").write_bytes(_tokenizer_json(self._path, stat.st_size, stat.st_mtime_ns))
        config = {
            "chat_template": _field(self._reader, "tokenizer.chat_template"),
            "model_max_length": self.config.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        for role, gguf_role in SPECIAL_TOKEN_METADATA.items():
            token_id = _field(self._reader, f"tokenizer.ggml.{gguf_role}_token_id")
            config[role] = tokens[token_id] if token_id is not None else None
        for flag in ("add_bos_token", "add_eos_token"):  # whether a raw text gets BOS / EOS (special_tokens.py)
            if (value := _field(self._reader, f"tokenizer.ggml.{flag}")) is not None:
                config[flag] = bool(value)
        write_json(dst_dir / "tokenizer_config.json", config)
        sampling = {key: _field(self._reader, gguf_key) for gguf_key, key in SAMPLING_METADATA.items()}
        write_json(dst_dir / "generation_config.json", self._generation_config(sampling))


    def special_tokens(self, tokenizer_config: dict, tokenizer) -> SpecialTokens:
        """tokenizer.ggml.add_bos_token / add_eos_token where the file has them (llama.cpp's rule), else what
        the rebuilt tokenizer.json's post-processor adds."""
        flags = [_field(self._reader, f"tokenizer.ggml.{flag}") for flag in ("add_bos_token", "add_eos_token")]
        if flags == [None, None]:
            return super().special_tokens(tokenizer_config, tokenizer)
        ids = [_field(self._reader, f"tokenizer.ggml.{role}_token_id") for role in ("bos", "eos")]
        return from_flags(tokenizer, bool(flags[0]), bool(flags[1]), *ids)


@functools.lru_cache(maxsize=2)
def _tokenizer_json(path: Path, size: int, mtime_ns: int) -> bytes:
    """tokenizer.json rebuilt from the GGUF vocabulary and merges by transformers' GGUF converter.

    Cached per unchanged file (size and mtime in the key): the rebuild takes seconds.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return (Path(tmp) / "tokenizer.json").read_bytes()


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    """The file's GGUFReader, cached per unchanged file (size and mtime in the key).

    The reader parses all metadata in Python: about 3 s for a 49k-token vocabulary.
    """
    return GGUFReader(path)


def load_gguf(path: Path, name: str | None = None) -> GGUFModelSpec:
    """Open a GGUF file, checking its architecture, metadata and every tensor's shape."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise KilnError(f"model: {path}: not a GGUF file (starts with {magic!r}); "
                        "expected a .gguf file or a Hugging Face model directory")
    try:
        stat = path.stat()
        reader = _gguf_reader(path, stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # the reader fails on truncation with ValueError, IndexError, struct errors...
        raise KilnError(f"model: {path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise KilnError(f"model: {path}: unsupported architecture {architecture!r}; "
                        f"Kiln supports GGUF architectures {', '.join(map(repr, ARCHITECTURES))}")
    gguf_tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in gguf_tensors:
        raise KilnError(f"model: {path}: rope frequency factors (rope_freqs, Llama 3.1 rope scaling) are not "
                        "supported from GGUF; build from the Hugging Face directory instead")
    if "token_embd.weight" not in gguf_tensors:
        raise KilnError(f"model: {path}: tensor token_embd.weight is missing")
    config = _config_from_metadata(reader, gguf_tensors, str(path), architecture)
    shapes = canonical_weight_shapes(config)
    tensors, expected = {}, {}
    for gguf_name, tensor in gguf_tensors.items():
        if gguf_name in ROPE_FACTOR_TENSORS:
            continue  # read into the config's rope scaling
        match = LAYER_TENSOR.fullmatch(gguf_name)
        if match and match[2] in EXPERT_STACKS:  # expert e: rows [e * rows, (e + 1) * rows) of the stack
            for e in range(config.num_experts):
                kiln_name = f"layers.{match[1]}.mlp.experts.{e}.{EXPERT_STACKS[match[2]]}.{match[3]}"
                if kiln_name not in shapes:
                    raise KilnError(f"model: {path}: unsupported tensor {gguf_name} for a {architecture} model")
                tensors[kiln_name] = (tensor, e * shapes[kiln_name][0])
            expected[gguf_name] = (config.num_experts, *shapes[kiln_name])
            continue
        if architecture == "phi3" and match and match[2] in PHI3_FUSED:
            first = 0
            for part in PHI3_FUSED[match[2]]:
                kiln_name = f"layers.{match[1]}.{part}.{match[3]}"
                if kiln_name not in shapes:
                    raise KilnError(f"model: {path}: unsupported tensor {gguf_name} for a {architecture} model")
                tensors[kiln_name] = (tensor, first)
                first += shapes[kiln_name][0]
            expected[gguf_name] = (first, *shapes[kiln_name][1:])
            continue
        kiln_name = canonical_name(gguf_name, architecture)
        if kiln_name is None:
            raise KilnError(f"model: {path}: unsupported tensor {gguf_name} for a {architecture} model")
        tensors[kiln_name] = (tensor, 0)
        expected[gguf_name] = shapes.get(kiln_name)
    for kiln_name in shapes:
        if kiln_name not in tensors:
            raise KilnError(f"model: {path}: tensor for {kiln_name} is missing")
    for gguf_name, shape in expected.items():
        found = tuple(int(n) for n in reversed(gguf_tensors[gguf_name].shape))  # ggml lists dims innermost first
        if gguf_name.endswith("ffn_gate_inp_shexp.weight") and found == shape[1:]:
            continue  # the shared expert's gate [1, H], stored as [H]
        if found != shape:
            raise KilnError(f"model: {path}: {gguf_name} has shape {list(found)}, metadata implies {list(shape)}")
    return GGUFModelSpec(name or path.stem, path, config, reader, tensors, architecture)


def _config_from_metadata(reader: GGUFReader, tensors: dict, where: str, arch: str) -> ModelConfig:
    def required(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise KilnError(f"model: {where}: GGUF metadata has no {arch}.{key}")
        return value

    hidden, num_heads = required("embedding_length"), required("attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // num_heads
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        raise KilnError(f"model: {where}: partial rotary (rope.dimension_count {rotary_dim} < head_dim "
                        f"{head_dim}) is not supported")
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise KilnError(f"model: {where}: rope scaling type {scaling_type!r} is not supported from GGUF")
    rope_scaling = _longrope(reader, tensors, arch, hidden // num_heads, where) if ROPE_FACTOR_TENSORS[0] in tensors \
        else None
    eos_ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    gemma = arch == "gemma3"
    moe = _moe_fields(reader, tensors, arch, required("block_count"), where) if _field(reader, f"{arch}.expert_count") \
        else {}
    return make_config(
        where,
        architecture=arch if gemma else "llama",
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length") or moe.get("expert_intermediate_size")
        or required("feed_forward_length"),
        num_layers=required("block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=_shortest_float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=_shortest_float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=required("context_length"),
        attention_bias="blk.0.attn_output.bias" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors and "blk.0.attn_output.bias" not in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        **(_gemma3_fields(reader, hidden, num_heads, head_dim, required("block_count"), where) if gemma else {}),
        **({"layer_windows": (window,) * required("block_count")}
           if arch == "phi3" and (window := _field(reader, "phi3.attention.sliding_window")) else {}),
        **({"qk_norm": True} if arch == "qwen3moe" else {}),
        **moe,
    )


def _moe_fields(reader: GGUFReader, tensors: dict, arch: str, layers: int, where: str) -> dict:
    """A mixture's ModelConfig fields: llama.cpp's expert metadata; its layers are those with a router tensor.
    The router's weights are renormalised over the chosen experts where llama.cpp does (Mixtral, a llama file;
    qwen3moe) or where the file says so (expert_weights_norm)."""
    experts, top_k = _field(reader, f"{arch}.expert_count"), _field(reader, f"{arch}.expert_used_count")
    if not top_k:
        raise KilnError(f"model: {where}: GGUF metadata has {arch}.expert_count but no {arch}.expert_used_count")
    moe_layers = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    stack = next((tensors[f"blk.{i}.ffn_up_exps.weight"] for i in moe_layers), None)
    if stack is None:
        raise KilnError(f"model: {where}: {arch}.expert_count is set but no layer has ffn_up_exps")
    shared = tensors.get(f"blk.{moe_layers[0]}.ffn_up_shexp.weight")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    return dict(num_experts=int(experts), experts_per_token=int(top_k),
                expert_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length") or stack.shape[1]),
                shared_expert_intermediate_size=int(shared.shape[1]) if shared is not None else 0,
                norm_topk_prob=bool(norm) if norm is not None else arch in ("llama", "qwen3moe"),
                moe_layers=moe_layers)


def _longrope(reader: GGUFReader, tensors: dict, arch: str, head_dim: int, where: str) -> dict:
    """Phi-3's LongRoPE from the file: the factor tensors, the original context length and the attention
    factor (llama.cpp's converter writes the one transformers derives)."""
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if not original:
        raise KilnError(f"model: {where}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
    factors = {key: tuple(_shortest_float(f) for f in np.asarray(tensors[f"rope_factors_{key.split('_')[0]}.weight"].data))
               for key in ("long_factor", "short_factor")}
    context = _field(reader, f"{arch}.context_length")
    attention = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        scale = context / original
        attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original),
            "attention_factor": float(attention)}


def _gemma3_fields(reader: GGUFReader, hidden: int, num_heads: int, head_dim: int, layers: int, where: str) -> dict:
    """Gemma 3's ModelConfig fields. The file stores its norms as 1 + weight already (llama.cpp's converter
    adds the 1), records the window but not the layer pattern, the local rope base or the softmax scale:
    those follow llama.cpp (every sixth layer global; base 10000; 1/sqrt(head_dim), and
    1/sqrt(hidden / heads) for the 62-layer 27B)."""
    window = _field(reader, "gemma3.attention.sliding_window")
    if not window:
        raise KilnError(f"model: {where}: GGUF metadata has no gemma3.attention.sliding_window")
    every = _field(reader, "gemma3.attention.sliding_window_pattern") or GEMMA3_GLOBAL_EVERY
    scalar = hidden // num_heads if layers == 62 else head_dim
    return dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norms=True,
                embedding_scale=float(np.float32(hidden ** 0.5)), attention_scale=float(scalar) ** -0.5,
                local_rope_theta=GEMMA3_LOCAL_THETA,
                layer_windows=tuple(0 if (i + 1) % every == 0 else int(window) for i in range(layers)))


def _shortest_float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.999999747e-06 -> 1e-05),
    which restores the value written in the original config.json."""
    return float(str(np.float32(value)))


def _field(reader: GGUFReader, key: str):
    """A metadata value as a Python int, float, str or list; None if the key is absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()
