"""Model shapes for the planner and the build budget: the sizes `engine-build plan` prices, read from a preset,
a config.json, a Hugging Face directory or a .gguf file (no weights are read), and the bytes a weight takes in
each format."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from builder.errors import KilnError
from builder.planning.plan import Device
from builder.sources import presets
from builder.sources.gguf_blocks import engine_bytes
from builder.sources.gguf_source import FLOAT_TYPES, load_gguf
from builder.sources.hf import layer_windows as hf_layer_windows
from runtime.format.engine_format import KV_CACHE_DTYPES

WEIGHT_FORMATS = ("none", "fp8", "int8", "int4")  # [quant] methods the planner prices
TPS = (1, 2, 4, 8)
PPS = (1, 2, 4, 8)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
INT4_GROUP = 128   # GPU plans: scales and zero points per 128 input channels
SCALE_BYTES = 8    # int4: an f32 scale and an f32 zero point per group (the cuda target's layout)


class PlanningError(KilnError):
    """Bad planner input, named in one line."""


# ---------------------------------------------------------------------------------------------- the model

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
HF_NAMES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "num_key_value_heads": "num_kv_heads"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0
    layer_windows: tuple[int, ...] = ()        # each layer's sliding window (0: full attention); () all full
    sandwich_norms: bool = False               # Gemma 3: norms after attention and the MLP too, and q/k norms
    source_bytes: dict | None = None           # a GGUF's weights' bytes in a "source" engine:
                                               # {"layers": ..., "embed": ..., "head": ..., "norms": ...}
    # a mixture of experts (ModelConfig's fields): each layer of moe_layers (() with experts: every layer) has a
    # router over num_experts MLPs of expert_intermediate_size, experts_per_token of them run a token, and a
    # shared expert where shared_expert_intermediate_size is set
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()

    @property
    def q(self) -> int:
        return self.num_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or layer in self.moe_layers)

    def expert_parameters(self) -> int:
        """One expert's gated MLP."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def router_and_shared(self, shared: bool = True) -> int:
        """A mixture layer's router, and its shared expert with that expert's gate (on the tp rank holding it)."""
        own = 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size \
            if shared and self.shared_expert_intermediate_size else 0
        return self.num_experts * self.hidden_size + own

    def layer_parameters(self, q_heads: int | None = None, kv_heads: int | None = None,
                         mlp: int | None = None, layer: int = 0, experts: float | None = None,
                         shared: bool = True) -> float:
        """Linear parameters of one layer, or of one rank's share of it. A mixture layer holds `experts` experts
        (default all; a fraction prices the experts a step reads, or a token's share of their products) and, with
        `shared`, the shared expert."""
        q = (self.num_heads if q_heads is None else q_heads) * self.head_dim
        kv = (self.num_kv_heads if kv_heads is None else kv_heads) * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.is_moe(layer):
            held = self.num_experts if experts is None else experts
            return attention + self.router_and_shared(shared) + held * self.expert_parameters()
        inter = self.intermediate_size if mlp is None else mlp
        return attention + 3 * self.hidden_size * inter

    @property
    def mean_layer_parameters(self) -> float:
        """A layer's linear parameters, averaged over the layers (a mixture's dense layers differ)."""
        return sum(self.layer_parameters(layer=i) for i in range(self.num_layers)) / self.num_layers

    @property
    def parameters(self) -> int:
        """Every weight: layers' linears, embedding, untied lm_head, norms."""
        tables = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        layers = sum(self.layer_parameters(layer=i) for i in range(self.num_layers))
        return int(layers + self.num_layers * self.layer_norm_parameters + tables + self.hidden_size)

    @property
    def active_parameters(self) -> int:
        """The weights one token reads: every layer's attention, a mixture's router, its experts_per_token experts
        and its shared expert, the embedding row aside (a lookup), the logits' table."""
        layers = sum(self.layer_parameters(layer=i, experts=self.experts_per_token) for i in range(self.num_layers))
        return int(layers + self.num_layers * self.layer_norm_parameters + self.vocab_size * self.hidden_size
                   + self.hidden_size)

    @property
    def layer_norm_parameters(self) -> int:
        """One layer's norm weights: two of hidden_size (Gemma 3: four, and its q and k norms of head_dim)."""
        return 4 * self.hidden_size + 2 * self.head_dim if self.sandwich_norms else 2 * self.hidden_size

    def kv_bytes_per_token(self, kv_dtype: str, layers: int | None = None, kv_heads: int | None = None) -> int:
        """K and V of one token in `layers` layers (default all) of `kv_heads` heads (default all)."""
        layers = self.num_layers if layers is None else layers
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * layers * heads * self.head_dim * KV_CACHE_DTYPES[kv_dtype].itemsize


def _shape_from_config(config: dict, name: str, where: str) -> ModelShape:
    """A ModelShape from config.json fields (Hugging Face names or Kiln's); one-line errors."""
    if isinstance(config.get("text_config"), dict):  # multimodal configs (Gemma 3) nest the decoder's
        config = {**config, **config["text_config"]}
    fields = {HF_NAMES.get(k, k): v for k, v in config.items()}
    missing = [f for f in SHAPE_FIELDS if f not in fields]
    if missing:
        raise PlanningError(f"model {where}: config lacks {', '.join(missing)} (planning needs "
                            f"{', '.join(SHAPE_FIELDS)}, and head_dim when hidden_size / num_heads is not it)")
    for f in SHAPE_FIELDS + ("head_dim",):
        value = fields.get(f, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PlanningError(f"model {where}: {f} must be a positive integer, got {value!r}")
    if fields["num_heads"] % fields["num_kv_heads"]:
        raise PlanningError(f"model {where}: num_kv_heads {fields['num_kv_heads']} does not divide "
                            f"num_heads {fields['num_heads']}")
    head_dim = fields.get("head_dim")
    if head_dim is None:
        if fields["hidden_size"] % fields["num_heads"]:
            raise PlanningError(f"model {where}: num_heads {fields['num_heads']} does not divide hidden_size "
                                f"{fields['hidden_size']} (give head_dim if the model's heads are not hidden_size "
                                f"/ num_heads wide)")
        head_dim = fields["hidden_size"] // fields["num_heads"]
    return ModelShape(name=name, head_dim=head_dim, **_moe_fields(fields, where),
                      tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
                      max_position_embeddings=int(fields.get("max_position_embeddings") or 0),
                      layer_windows=_layer_windows(fields, where),
                      sandwich_norms=str(fields.get("model_type", fields.get("architecture", ""))).startswith("gemma3"),
                      **{f: fields[f] for f in SHAPE_FIELDS})


def _moe_fields(fields: dict, where: str) -> dict:
    """A mixture's ModelShape fields from Kiln's names (a GGUF's config) or Hugging Face's (Mixtral's
    num_local_experts and intermediate_size, Qwen's num_experts, moe_intermediate_size, shared expert and sparse
    layers)."""
    experts = fields.get("num_experts") or fields.get("num_local_experts") or 0
    if not experts:
        return {}
    top_k = fields.get("experts_per_token") or fields.get("num_experts_per_tok")
    size = (fields.get("expert_intermediate_size") or fields.get("moe_intermediate_size")
            or fields["intermediate_size"])
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise PlanningError(f"model {where}: a mixture of {experts} experts needs num_experts_per_tok in 1..{experts}")
    layers = fields["num_layers"]
    if fields.get("moe_layers"):
        moe = tuple(int(i) for i in fields["moe_layers"])
    else:
        step, dense = fields.get("decoder_sparse_step") or 1, set(fields.get("mlp_only_layers") or ())
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=int(experts), experts_per_token=int(top_k), expert_intermediate_size=int(size),
                shared_expert_intermediate_size=int(fields.get("shared_expert_intermediate_size") or 0),
                moe_layers=() if moe == tuple(range(layers)) else moe)


def _layer_windows(fields: dict, where: str) -> tuple[int, ...]:
    """Each layer's sliding window, as a build reads it: Kiln's own layer_windows (a GGUF's), a window on all
    but every sliding_window_pattern-th layer (the presets' Gemma 3), else as from a Hugging Face config."""
    layers, window, pattern = fields["num_layers"], fields.get("sliding_window"), fields.get("sliding_window_pattern")
    if fields.get("layer_windows") is not None:
        return tuple(int(w) for w in fields["layer_windows"])
    if window and pattern and "layer_types" not in fields:
        return tuple(0 if (i + 1) % pattern == 0 else int(window) for i in range(layers))
    try:
        return hf_layer_windows({**fields, "num_hidden_layers": layers}, where)
    except KilnError as exc:
        raise PlanningError(str(exc)) from None


def model_presets() -> dict[str, dict]:
    return tomllib.loads((resources.files("plans") / "models.toml").read_text())


def load_shape(source: str) -> ModelShape:
    """A preset of plans/models.toml, a config.json, a Hugging Face directory, a .gguf file, or a
    buildable preset (its GGUF: the bytes it stores are what `[quant] method = "source"` keeps)."""
    if source in presets.PRESETS:
        try:
            return _gguf_shape(presets.resolve_preset(source), source)
        except KilnError:
            pass  # not installed: its published shape below
    known = model_presets()
    if source in known:
        return _shape_from_config(known[source], source, source)
    path = Path(source).expanduser()
    if not path.exists():
        raise PlanningError(f"model {source}: no such file, directory or preset (presets: {', '.join(known)}; "
                            f"or a config.json, a Hugging Face directory, a .gguf file)")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanningError(f"model {source}: a directory without config.json")
    if path.suffix == ".gguf":
        return _gguf_shape(path, path.stem)
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanningError(f"model {source}: not a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise PlanningError(f"model {source}: not a JSON object")
    return _shape_from_config(config, path.parent.name if path.name == "config.json" else path.stem, source)


def _gguf_shape(path: Path, name: str) -> ModelShape:
    model = load_gguf(path, name=name)  # its reader is the build's (parsed once a file: seconds)
    config = model.config
    # quantized blocks at the bytes of the Kiln format that keeps (or requantizes) them
    tensors = {t.name: int(t.n_bytes) if t.tensor_type.name in FLOAT_TYPES
               else round(engine_bytes(t.tensor_type.name, int(t.n_elements))) for t in model.stored_tensors}
    embed = tensors.get("token_embd.weight", 0)
    head = tensors.get("output.weight", 0)
    layers = sum(n for t, n in tensors.items() if t.startswith("blk.") and not t.endswith("norm.weight"))
    norms = sum(n for t, n in tensors.items() if t.endswith("norm.weight"))
    shape = _shape_from_config(config.to_dict(), name, str(path))
    return replace(shape, source_bytes={"layers": layers, "embed": embed, "head": head, "norms": norms})


# ---------------------------------------------------------------------------------------------- workloads


def bytes_per_weight(weights: str, device: Device, group: int) -> float:
    if weights in ("none", "source"):  # "source" without a GGUF's blocks: the checkpoint's floats
        return 2.0 if device.kind == "gpu" else 4.0
    if weights == "int4":
        return 0.5 + SCALE_BYTES / group
    return 1.0  # int8, fp8: a scale per output channel

