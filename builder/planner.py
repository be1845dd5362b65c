"""`engine-build plan`: price candidate plans for a model and a workload before anything is built.

A candidate is a device of the catalog (plans/devices.toml) x tensor parallelism x pipeline
parallelism x weight format x KV cache dtype, validated as a plan file would be. For each one:

- memory per rank: weights from the model's shape (no weights are read), the activation workspace
  and the KV blocks the rest holds, by runtime.memory_plan, the arithmetic the build's plan_memory
  pass and the runtime use, with each rank's share from runtime.mapping, the sharding passes' own;
- a roofline of a step: a stage reads its weights and its sequences' KV once per step and does two
  operations per weight and token, at the device's peaks times its efficiencies; tensor parallelism
  adds two all-reduces a layer (ring: 2 (tp-1)/tp of the message over the link, plus its latency);
  a step passes every pipeline stage in turn, with pp batches in flight, so pipelining adds
  throughput, not speed for one sequence;
- with a workload (concurrent users, prompt and answer lengths, latency objectives): the largest
  batch a replica serves within the objectives, hence replicas, devices and cost. Each sequence
  brings its prompt's tokens along with its answer's, so a step's tokens are B x (1 + input / output).

Every figure is an estimate from published peaks and assumed efficiencies, except on the cpu device,
whose efficiencies are calibrated against `engine-run bench` on the machine Kiln is developed on.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from builder.errors import KilnError
from builder.plan import Device, Plan, PlanError, load_devices, plan_from_dict
from runtime.engine_format import GIB, KV_CACHE_DTYPES
from runtime.kv_groups import group_windows, shared_pools, window_blocks_per_sequence
from runtime.mapping import Mapping
from runtime.memory_plan import RankMemoryPlan, workspace_bytes

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
    from builder.hf import layer_windows as hf_layer_windows

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
    from builder import presets

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
    from builder.gguf_blocks import engine_bytes
    from builder.gguf_source import FLOAT_TYPES, load_gguf

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

@dataclass(frozen=True)
class Workload:
    input_tokens: int = 512
    output_tokens: int = 256
    users: int | None = None              # concurrent requests in flight
    latency_s: float | None = None        # p99 time to the whole answer
    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def context(self) -> int:
        return self.input_tokens + self.output_tokens

    def check(self) -> None:
        for key in ("input_tokens", "output_tokens", "users"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise PlanningError(f"workload: {key.replace('_tokens', '')} must be >= 1, got {value}")
        for key in ("latency_s", "ttft_s", "itl_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise PlanningError(f"workload: {key[:-2]} must be > 0 seconds, got {value}")


# ---------------------------------------------------------------------------------------------- candidates

@dataclass
class Candidate:
    device: str
    tp: int
    pp: int
    weights: str
    kv_dtype: str
    plan: Plan | None = None
    problem: str | None = None                        # why it does not fit (None: it fits)
    weight_gib: float = 0.0                           # the fullest rank's
    workspace_gib: float = 0.0
    kv_gib: float = 0.0
    kv_tokens: int = 0
    kv_pools: tuple[int, ...] = ()                    # blocks of each KV group's pool (runtime/kv_groups.py)
    sequences: int = 0                                # at the workload's context length
    prefill_s: float = 0.0                            # one prompt of the workload's input length, alone
    decode: dict[int, float] = field(default_factory=dict)   # batch -> seconds of a decode step (ITL)
    serving: dict[int, float] = field(default_factory=dict)  # batch -> seconds of a serving step, which
                                                             # carries prompt tokens too (module docstring)
    sizing: dict | None = None

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def fits(self) -> bool:
        return self.problem is None

    def tokens_per_s(self, batch: int) -> float:
        """Aggregate decode tokens/s of a replica with `batch` sequences a step (pp batches in flight)."""
        return self.pp * batch / self.decode[batch]

    def to_dict(self) -> dict:
        doc = {k: v for k, v in asdict(self).items() if k not in ("plan", "decode", "serving")}
        doc["decode"] = {str(b): {"itl_ms": 1e3 * s, "tokens_per_s": self.tokens_per_s(b)}
                         for b, s in self.decode.items()}
        doc["serving"] = {str(b): {"itl_ms": 1e3 * s, "tokens_per_s": self.pp * b / s} for b, s in self.serving.items()}
        return doc


def candidate_plan(device: Device, tp: int, pp: int, weights: str, kv_dtype: str, workload: Workload,
                   max_batch: int, experts: bool = False) -> Plan:
    """The plan file this candidate would be, validated like one (PlanError if it is not buildable). experts: a
    mixture's whole experts split between the tp ranks (ep = tp), as `price` assumes."""
    gpu = device.kind == "gpu"
    max_seq = 1 << max(4, math.ceil(math.log2(workload.context)))
    # GPUs: the cuda target (Kiln's kernels, compiled for the device; it serves on Hopper, which TensorRT for
    # RTX refuses), priced in its bf16 activations
    doc = {"target": "cuda" if gpu else "cpu", "device": device.name, "tp": tp, "pp": pp,
           **({"ep": tp} if experts and tp > 1 else {}),
           "limits": {"max_batch_size": max_batch, "max_num_tokens": max(2048 if gpu else 512, max_batch),
                      "max_seq_len": max_seq},
           "kv_cache": {"dtype": kv_dtype, "block_size": 16, "memory_fraction": 0.9 if gpu else 0.5},
           "quant": {"method": weights, "group_size": INT4_GROUP if gpu else 32}}
    return plan_from_dict(doc, "candidate")


def bytes_per_weight(weights: str, device: Device, group: int) -> float:
    if weights in ("none", "source"):  # "source" without a GGUF's blocks: the checkpoint's floats
        return 2.0 if device.kind == "gpu" else 4.0
    if weights == "int4":
        return 0.5 + SCALE_BYTES / group
    return 1.0  # int8, fp8: a scale per output channel


def _price_kv(c: Candidate, ranks: list[RankMemoryPlan], windows: tuple[int, ...], context: int) -> None:
    """The candidate's KV cache: the pools every rank allocates (the rank that fits the fewest, per pool), their
    size on the rank that holds the most, and the sequences of `context` tokens they hold at once."""
    pools = shared_pools(windows, [r.pools for r in ranks], [r.uses_pools for r in ranks]).num_blocks
    bs = c.plan.kv_cache.block_size

    def pool_bytes(r: RankMemoryPlan) -> int:
        if len(pools) == 1:
            return pools[0] * bs * r.kv_bytes_per_token
        return bs * (pools[0] * (r.kv_bytes_per_token - r.window_bytes_per_token) + pools[1] * r.window_bytes_per_token)

    c.kv_pools, c.kv_tokens = pools, pools[0] * bs
    c.kv_gib = max(map(pool_bytes, ranks)) / GIB
    needs = [window_blocks_per_sequence(w, bs, c.plan.limits.max_num_tokens, context) if w else -(-context // bs)
             for w in windows]
    c.sequences = min(blocks // need for blocks, need in zip(pools, needs))


def price(model: ModelShape, c: Candidate, device: Device, workload: Workload, batches: list[int]) -> None:
    """Fill in the candidate's memory plan, roofline and (with users) sizing."""
    plan = c.plan
    # The cpu runtime gives windowed layers a pool of their own; the GPU backends one pool for all.
    windows = group_windows(model.layer_windows) if plan.target == "cpu" else (0,)
    float_bytes = 2.0 if device.kind == "gpu" else 4.0
    wbytes = bytes_per_weight(plan.quant.method, device, plan.quant.group_size)
    src = model.source_bytes  # a GGUF's weights as kept: its linears under "source", its excluded tables always
    source = src is not None and plan.quant.method == "source"
    kept = src if plan.quant.method != "none" else None  # "none" makes every weight float
    costs = [float(model.layer_parameters(layer=i)) for i in range(model.num_layers)]
    head_rows = model.vocab_size * model.hidden_size
    ranks = []
    for rank in range(c.devices):
        mapping = Mapping(c.tp, c.pp, rank)
        stage = mapping.pp_layers(model.num_layers, costs, 0.0, float(head_rows))
        layers = len(stage)
        windowed = sum(1 for i in stage if model.window(i))
        heads = mapping.attention_heads(model.num_heads, model.num_kv_heads)
        mlp = mapping.columns(model.intermediate_size, "intermediate_size").count
        vocab = mapping.columns(model.vocab_size, "vocab_size").count
        # a mixture's experts are split between the tp ranks (as shard_tensor_parallel does), the shared one on the
        # first; a step reads only the experts its tokens chose, and does a token's products on k / E of them
        t = mapping.tp_rank
        held = (t + 1) * model.num_experts // c.tp - t * model.num_experts // c.tp
        mine = dict(q_heads=heads.q.count, kv_heads=heads.kv.count, mlp=mlp, shared=t == 0)
        params = sum(model.layer_parameters(**mine, layer=i, experts=held) for i in stage)
        moe_stage = sum(model.is_moe(i) for i in stage)
        expert_params = moe_stage * held * model.expert_parameters()
        flop_params = params - expert_params * (1 - model.experts_per_token / model.num_experts) \
            if model.num_experts else params
        share = params / sum(costs)
        linear = src["layers"] * share if source else params * wbytes
        table = vocab * model.hidden_size
        first, last = mapping.is_first_pp_rank(), mapping.is_last_pp_rank()
        embed = (kept["embed"] * vocab / model.vocab_size if kept else table * float_bytes)
        head = 0.0
        if last:
            head = (kept["head"] * vocab / model.vocab_size if kept and kept["head"] else
                    embed if model.tie_word_embeddings else table * float_bytes)
        norms = (layers * model.layer_norm_parameters + last * model.hidden_size) * float_bytes  # the final one too
        if src:
            norms = src["norms"] * (2 * layers + last) / (2 * model.num_layers + 1)
        stored = linear + norms + (embed if first else 0.0) \
            + (head if not (first and model.tie_word_embeddings) else 0.0)
        widest = max(model.hidden_size, (heads.q.count + 2 * heads.kv.count) * model.head_dim, 2 * mlp,
                     2 * model.expert_intermediate_size)
        memory = RankMemoryPlan(
            weight_bytes=int(stored), memory_bytes=device.memory_gib * GIB,
            workspace_bytes=workspace_bytes(plan.limits.max_num_tokens, widest, plan.limits.max_batch_size,
                                            model.vocab_size, plan.target),
            kv_bytes_per_token=model.kv_bytes_per_token(plan.kv_cache.dtype, layers, heads.kv.count),
            memory_fraction=plan.kv_cache.memory_fraction, block_size=plan.kv_cache.block_size,
            max_seq_len=plan.limits.max_seq_len, windows=windows,
            window_bytes_per_token=model.kv_bytes_per_token(plan.kv_cache.dtype, windowed, heads.kv.count)
            if windows != (0,) else 0,
            max_batch_size=plan.limits.max_batch_size, max_num_tokens=plan.limits.max_num_tokens)
        expert_bytes = linear * expert_params / params if params else 0.0
        ranks.append((memory, flop_params, linear + head, layers, heads.q.count, vocab if last else 0, expert_bytes))
        if c.problem is None:
            c.problem = memory.problem(device.name, rank)
    fullest = max(ranks, key=lambda r: r[0].weight_bytes)[0]
    c.weight_gib, c.workspace_gib = fullest.weight_bytes / GIB, fullest.workspace_bytes / GIB
    _price_kv(c, [r[0] for r in ranks], windows, workload.context)
    if not c.fits:
        return
    stages = [max(ranks[s * c.tp:(s + 1) * c.tp], key=lambda r: r[2]) for s in range(c.pp)]  # its slowest rank
    compute = device_compute(device, plan.quant.method) * device.compute_efficiency
    bandwidth = device.bandwidth_gbs * 1e9 * device.bandwidth_efficiency
    if device.kind == "cpu":  # one host: its ranks share its cores and its memory bandwidth
        compute, bandwidth = compute / c.devices, bandwidth / c.devices

    def step(tokens: int, sequences: int, context: float) -> float:
        """Seconds of one step through every stage: `tokens` tokens of `sequences` sequences of `context`
        (a windowed layer reads its window's keys only)."""
        total = 0.0
        for memory, params, read, layers, q_heads, vocab, experts in stages:
            if experts:  # the experts no token of the step chose stay unread (uniform routing)
                read -= experts * (1 - model.experts_per_token / model.num_experts) ** tokens
            window_bytes = memory.window_bytes_per_token
            kv = sequences * (context * (memory.kv_bytes_per_token - window_bytes)
                              + min(context, max(model.layer_windows, default=0)) * window_bytes)
            flops = 2 * tokens * (params + vocab * model.hidden_size) \
                + 4 * tokens * context * q_heads * model.head_dim * layers
            total += max((read + kv) / bandwidth, flops / compute)
            total += (2 * layers + 1) * allreduce(device, c.tp, tokens * model.hidden_size * 2)
        return total + (c.pp - 1) * transfer(device, tokens * model.hidden_size * 2)

    c.prefill_s = step(workload.input_tokens, 1, workload.input_tokens / 2)
    context = workload.input_tokens + workload.output_tokens / 2
    prompt_share = workload.input_tokens / workload.output_tokens
    for batch in batches:
        if c.pp * batch <= max(c.sequences, 1):
            c.decode[batch] = step(batch, batch, context)
    for batch in sorted(set(batches) | set(range(8, max(batches) + 1, 8))):  # sizing picks among these
        if c.pp * batch <= max(c.sequences, 1):
            c.serving[batch] = step(round(batch * (1 + prompt_share)), batch, context)
    if workload.users:
        c.sizing = size(c, workload, device)


def device_compute(device: Device, weights: str) -> float:
    """FLOP/s of the products: FP8 tensor cores for fp8 weights where there are some, else 16-bit ones
    (integer weights are dequantized to the activations' type)."""
    tflops = device.tflops_fp8 if weights == "fp8" and device.tflops_fp8 else device.tflops_16
    return tflops * 1e12


def allreduce(device: Device, tp: int, message: float) -> float:
    if tp == 1:
        return 0.0
    return device.link_latency_us * 1e-6 + 2 * (tp - 1) / tp * message / (device.link_gbs * 1e9)


def transfer(device: Device, message: float) -> float:
    return device.link_latency_us * 1e-6 + message / (device.link_gbs * 1e9)


def size(c: Candidate, workload: Workload, device: Device) -> dict:
    """The largest batch within the objectives and the KV capacity, and what serving `users` takes."""
    best = None
    for batch, itl in c.serving.items():
        if c.pp * batch > c.sequences:
            break
        ttft = c.prefill_s + itl
        latency = ttft + workload.output_tokens * itl
        if ((workload.latency_s and latency > workload.latency_s) or (workload.ttft_s and ttft > workload.ttft_s)
                or (workload.itl_s and itl > workload.itl_s)):
            break
        best = {"batch": batch, "itl_s": itl, "ttft_s": ttft, "latency_s": latency}
    if best is None:
        return {"feasible": False}
    per_replica = c.pp * best["batch"]
    replicas = -(-workload.users // per_replica)
    tokens_per_s = replicas * per_replica / best["itl_s"]
    out = {**best, "feasible": True, "replicas": replicas, "devices": replicas * c.devices,
           "output_tokens_per_s": tokens_per_s}
    if device.price_per_hour is not None:
        hourly = out["devices"] * device.price_per_hour
        out.update(usd_per_hour=hourly, usd_per_million_tokens=hourly / (tokens_per_s * 3600) * 1e6)
    return out


@dataclass
class Report:
    model: ModelShape
    workload: Workload
    candidates: list[Candidate]
    unbuildable: list[tuple[str, str]]      # (candidate, why the plan is refused)

    @property
    def recommended(self) -> Candidate | None:
        ranked = [c for c in self.candidates if c.fits and (c.sizing is None or c.sizing["feasible"])]
        return ranked[0] if ranked else None

    def to_dict(self) -> dict:
        best = self.recommended
        return {"model": asdict(self.model), "workload": asdict(self.workload),
                "candidates": [c.to_dict() for c in self.candidates],
                "unbuildable": [{"candidate": n, "why": w} for n, w in self.unbuildable],
                "recommended": best.to_dict() if best else None}


def plan_candidates(model: ModelShape, devices: list[str] | None = None, tps: list[int] | None = None,
                    pps: list[int] | None = None, weights: list[str] | None = None,
                    kv_dtypes: list[str] | None = None, workload: Workload | None = None,
                    prices: dict[str, float] | None = None, max_batch: int = 256, plan: Plan | None = None) -> Report:
    """Every candidate priced and ranked: fitting ones first; with users, those that meet the
    objectives, by cost (then devices); without, by decode tokens/s per device at the batch the KV
    cache holds."""
    workload = workload or Workload()
    workload.check()
    catalog = load_devices()
    names = devices or [n for n, d in catalog.items() if d.kind == "gpu"]
    unknown = [n for n in names if n not in catalog]
    if unknown:
        raise PlanningError(f"device {unknown[0]!r} is not in the catalog (known: {', '.join(catalog)})")
    for name, usd in (prices or {}).items():
        if name not in catalog:
            raise PlanningError(f"--price {name}: not a device of the catalog (known: {', '.join(catalog)})")
        catalog[name] = replace(catalog[name], price_per_hour=usd)
    sizes = (model.num_heads, model.num_kv_heads, model.intermediate_size, model.hidden_size)
    for t in tps or []:
        if t < 1 or t > model.num_heads or all(n % t for n in sizes):
            raise PlanningError(f"--tp {t}: divides none of the model's sizes (heads {model.num_heads}, KV heads "
                                f"{model.num_kv_heads}, intermediate {model.intermediate_size}, hidden "
                                f"{model.hidden_size}); use one of "
                                f"{', '.join(str(d) for d in TPS if d <= model.num_heads and model.num_heads % d == 0)}")
    for p in pps or []:
        if not 1 <= p <= model.num_layers:
            raise PlanningError(f"--pp {p}: must be between 1 and the model's {model.num_layers} layers")
    batches = [b for b in BATCHES if b <= max_batch]
    if plan is not None:  # one plan, priced as written
        c = Candidate(plan.device, plan.tp, plan.pp, plan.quant.method, plan.kv_cache.dtype, plan)
        price(model, c, catalog[plan.device], workload, [b for b in batches if b <= plan.limits.max_batch_size])
        return Report(model, workload, [c], [])
    formats = weights or (["source"] if model.source_bytes else []) + list(WEIGHT_FORMATS)
    candidates, unbuildable = [], []
    for name in names:
        device = catalog[name]
        for fmt in formats:
            for kv in kv_dtypes or ["f16"]:
                fitted_at = None
                for pp in pps or PPS:
                    if fitted_at is not None and not pps:
                        break  # deeper pipelines only where shallower ones do not fit
                    for tp in tps or TPS:
                        if (not tps and tp > device.gpus_per_node) or tp > model.num_heads or pp > model.num_layers:
                            continue
                        label = f"{name} tp={tp} pp={pp} {fmt} kv={kv}"
                        try:
                            plan = candidate_plan(device, tp, pp, fmt, kv, workload, max_batch,
                                                  bool(model.num_experts))
                        except PlanError as exc:
                            unbuildable.append((label, str(exc).split(": ", 1)[-1]))
                            continue
                        c = Candidate(name, tp, pp, fmt, kv, plan)
                        price(model, c, device, workload, batches)
                        candidates.append(c)
                        if c.fits and fitted_at is None:
                            fitted_at = pp
    candidates.sort(key=lambda c: _rank_key(c, catalog))
    return Report(model, workload, candidates, unbuildable)


def _rank_key(c: Candidate, catalog: dict[str, Device]) -> tuple:
    if not c.fits:
        return (2, c.device, c.weights, c.tp * c.pp)
    if c.sizing is not None:
        if not c.sizing["feasible"]:
            return (1, c.device, c.weights, c.tp * c.pp)
        return (0, c.sizing.get("usd_per_hour", math.inf), c.sizing["devices"])
    top = max(c.decode)
    return (0, -c.tokens_per_s(top) / c.devices, c.devices)


def plan_toml(c: Candidate, model: ModelShape, workload: Workload) -> str:
    """The candidate as a plan file for `engine-build build --plan`."""
    p = c.plan
    sizing = f"; {c.sizing['replicas']} replica(s) for {workload.users} users" if c.sizing else ""
    lines = [f"# Written by `engine-build plan` for {model.name}: {c.device}, tp={c.tp}, pp={c.pp}, "
             f"{c.weights} weights, {c.kv_dtype} KV cache{sizing}.",
             f"# Per rank: weights {c.weight_gib:.2f} GiB, KV cache {c.kv_gib:.2f} GiB = {c.kv_tokens} tokens, "
             f"{c.sequences} sequences of {workload.context} tokens.",
             f'target = "{p.target}"', f'device = "{p.device}"', f"tp = {p.tp}", f"pp = {p.pp}",
             *([f"ep = {p.ep}"] if p.ep > 1 else []), "",
             "[limits]", f"max_batch_size = {p.limits.max_batch_size}",
             f"max_num_tokens = {p.limits.max_num_tokens}", f"max_seq_len = {p.limits.max_seq_len}", "",
             "[kv_cache]", f'dtype = "{p.kv_cache.dtype}"', f"block_size = {p.kv_cache.block_size}",
             f"memory_fraction = {p.kv_cache.memory_fraction}", "",
             "[quant]", f'method = "{p.quant.method}"', f"group_size = {p.quant.group_size}",
             f"exclude = {json.dumps(list(p.quant.exclude))}", f'activations = "{p.quant.activations}"']
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- output

def table_rows(report: Report, show_all: bool = False, limit: int = 12) -> tuple[list[str], list[list[str]]]:
    """Column titles and rows of the terminal table: the ranked candidates (the first `limit` that fit,
    then one line per device and format that does not), or every one with show_all."""
    sizing = report.workload.users is not None
    titles = ["#", "device", "tp", "pp", "weights", "kv", "weights/rank", "KV/rank", "KV tokens",
              f"seqs of {report.workload.context}", f"prefill {report.workload.input_tokens}", "tok/s b=1",
              "tok/s (batch)"]
    if sizing:  # the sizing columns instead of the single-replica speeds
        titles = titles[:8] + [titles[9], "batch", "ITL", "latency", "devices", "$/h", "$/1M tok"]
    titles.append("fits")
    rows, shown_misfits = [], set()
    fitting = 0
    for i, c in enumerate(report.candidates, 1):
        if not show_all:
            if c.fits:
                fitting += 1
                if fitting > limit:
                    continue
            elif (c.device, c.weights, c.kv_dtype) in shown_misfits:
                continue
            else:
                shown_misfits.add((c.device, c.weights, c.kv_dtype))
        top = max(c.decode) if c.decode else None
        row = [str(i), c.device.removeprefix("nvidia-"), str(c.tp), str(c.pp), c.weights, c.kv_dtype,
               _size(c.weight_gib), _size(c.kv_gib), f"{c.kv_tokens:,}", f"{c.sequences:,}",
               f"{c.prefill_s * 1e3:.0f} ms" if c.fits else "",
               f"{c.tokens_per_s(1):.0f}" if 1 in c.decode else "",
               f"{c.tokens_per_s(top):,.0f} ({top})" if top else ""]
        if sizing:
            row = row[:8] + [row[9]]
            z = c.sizing or {}
            if z.get("feasible"):
                row += [str(z["batch"]), f"{z['itl_s'] * 1e3:.1f} ms", f"{z['latency_s']:.2f} s", str(z["devices"]),
                        f"{z['usd_per_hour']:,.0f}" if "usd_per_hour" in z else "-",
                        f"{z['usd_per_million_tokens']:.3f}" if "usd_per_million_tokens" in z else "-"]
            else:
                row += ["", "", "", "", "", ""]
        row.append("yes" if c.fits and (not sizing or (c.sizing or {}).get("feasible")) else
                   ("misses the objectives" if c.fits else "no: " + _short_problem(c.problem)))
        rows.append(row)
    return titles, rows


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def _short_problem(problem: str) -> str:
    """The part of a plan_memory message after the rank: what is short."""
    return problem.split(": ", 1)[-1].split(";")[0]


def summary_lines(report: Report) -> list[str]:
    m, w = report.model, report.workload
    lines = [f"model {m.name}: {m.parameters / 1e9:.2f} B parameters, {m.num_layers} layers, {m.num_heads} query / "
             f"{m.num_kv_heads} KV heads of {m.head_dim}; KV cache {m.kv_bytes_per_token('f16'):,} B a token in f16",
             *([f"mixture of experts: {m.num_experts} experts of {m.expert_intermediate_size}, {m.experts_per_token} a "
                f"token{', a shared expert' if m.shared_expert_intermediate_size else ''}: "
                f"{m.active_parameters / 1e9:.2f} B parameters read a token of {m.parameters / 1e9:.2f} B; tp ranks "
                "split the experts and all-reduce each mixture's output (hidden_size x 2 bytes a token)"]
               if m.num_experts else []),
             f"workload: {w.input_tokens}-token prompts, {w.output_tokens}-token answers"
             + (f", {w.users:,} concurrent users" if w.users else "")
             + "".join(f", {name} <= {value:g} s" for name, value in
                       (("latency p99", w.latency_s), ("TTFT", w.ttft_s), ("ITL", w.itl_s)) if value)]
    fitting = sum(c.fits for c in report.candidates)
    smallest: dict[tuple[str, str], Candidate] = {}
    for c in report.candidates:
        key = (c.device, c.weights)
        if c.fits and (key not in smallest or c.devices < smallest[key].devices):
            smallest[key] = c
    order = {w: i for i, w in enumerate(("source",) + WEIGHT_FORMATS)}
    for device in dict.fromkeys(c.device for c in report.candidates):
        fits = [f"{w} tp={c.tp}" + (f" pp={c.pp}" if c.pp > 1 else "")
                for (d, w), c in sorted(smallest.items(), key=lambda item: order.get(item[0][1], 9)) if d == device]
        misfit = sorted({c.weights for c in report.candidates if c.device == device} - {w for d, w in smallest if d == device})
        lines.append(f"{device}: fewest devices that fit: {', '.join(fits) or 'none'}"
                     + (f"; never fits: {', '.join(misfit)}" if misfit else ""))
    lines.append(f"{len(report.candidates)} candidates, {fitting} fit"
                 + (f"; {len(report.unbuildable)} plans refused as unbuildable (--json lists them)"
                    if report.unbuildable else ""))
    if w.users and any(c.sizing and c.sizing["feasible"] and "usd_per_hour" not in c.sizing for c in report.candidates):
        lines.append("ranked by cost where the catalog has a price; devices without one (--price DEVICE=USD) "
                     "follow, by device count")
    return lines


def recommendation_lines(report: Report) -> list[str]:
    best = report.recommended
    w = report.workload
    if best is None:
        return [no_candidate_message(report)]
    line = (f"recommended: {best.device} tp={best.tp} pp={best.pp}, {best.weights} weights, {best.kv_dtype} KV cache: "
            f"{_size(best.weight_gib)} of weights and {_size(best.kv_gib)} of KV cache a rank, "
            f"{best.sequences:,} sequences of {w.context} tokens")
    z = best.sizing
    if z:
        line += (f"; {z['replicas']} replica(s) x {best.devices} = {z['devices']} device(s) serve {w.users:,} users at "
                 f"batch {z['batch']} a stage, ITL {z['itl_s'] * 1e3:.1f} ms, latency {z['latency_s']:.2f} s")
        if "usd_per_hour" in z:
            line += f", ${z['usd_per_hour']:,.0f}/h, ${z['usd_per_million_tokens']:.3f} per million output tokens"
    return [line, build_line(report.model, best.plan)]


def build_line(model: ModelShape, plan) -> str:
    """What building the plan holds on the build host (builder/build_budget.py)."""
    from builder.build_budget import price_build

    whole = price_build(model, plan)
    line = f"build: {whole.describe()} on the build host"
    if plan.world_size > 1 and plan.target == "cpu":
        line += f"; each of ranks 1 to {plan.world_size - 1} built alone (--rank) {price_build(model, plan, 1).describe()}"
    return line


def no_candidate_message(report: Report) -> str:
    """What would make a workload servable when no candidate can."""
    w = report.workload
    if not any(c.fits for c in report.candidates):
        return ("no candidate fits: allow more devices (--tp, --pp), a smaller KV dtype (--kv-dtype fp8 or int8 where "
                "the target takes it), quantized weights (--weights int4 or fp8), or shorter prompts and answers")
    return (f"no candidate meets the objectives for {w.users:,} users at {w.input_tokens}+{w.output_tokens} tokens: "
            f"loosen the latency objectives, allow larger tensor parallelism (faster steps) or faster devices")


def plot(report: Report, path: Path, count: int = 6) -> None:
    """PNG: memory per rank of the top candidates (weights, workspace, KV cache) and their decode
    tokens/s against batch size."""
    from runtime.bench import require_matplotlib

    try:
        plt = require_matplotlib()
    except ValueError as exc:
        raise PlanningError(str(exc)) from None  # the message names --plot and the extra
    shown = [c for c in report.candidates if c.fits][:count]
    if not shown:
        raise PlanningError("--plot: no candidate fits, nothing to draw")
    labels = [f"{c.device.replace('nvidia-', '')}\ntp{c.tp} pp{c.pp} {c.weights}" for c in shown]
    fig, (mem, tput) = plt.subplots(1, 2, figsize=(13, 5))
    bottom = [0.0] * len(shown)
    for name, values, color in (("weights", [c.weight_gib for c in shown], "#4c72b0"),
                                ("workspace", [c.workspace_gib for c in shown], "#dd8452"),
                                ("KV cache", [c.kv_gib for c in shown], "#55a868")):
        mem.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.set_ylabel("GiB per rank (the fullest rank)")
    mem.set_title(f"{report.model.name}: memory per rank")
    mem.set_ylim(0, max(bottom) * 1.2)  # room for the legend above the bars
    mem.legend(ncol=3, loc="upper center")
    mem.tick_params(axis="x", labelsize=8)
    for c, label in zip(shown, labels):
        batches = sorted(c.decode)
        tput.plot(batches, [c.tokens_per_s(b) for b in batches], marker="o", label=label.replace("\n", " "))
    tput.set_xscale("log", base=2)
    tput.set_yscale("log")
    tput.set_xlabel("sequences per step (batch)")
    tput.set_ylabel("decode tokens/s per replica (estimate)")
    tput.set_title(f"decode at {report.workload.input_tokens}+{report.workload.output_tokens} tokens")
    tput.legend(fontsize=7)
    tput.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
