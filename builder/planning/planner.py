"""`engine-build plan`: price candidate plans for a model and a workload before anything is built.

A candidate is a device of the catalog (plans/devices.toml) x tensor parallelism x pipeline
parallelism x weight format x KV cache dtype, validated as a plan file would be. For each one:

- memory per rank: weights from the model's shape (no weights are read), the activation workspace
  and the KV blocks the rest holds, by runtime.format.memory_plan, the arithmetic the build's plan_memory
  pass and the runtime use, with each rank's share from runtime.format.mapping, the sharding passes' own;
- a roofline of a step: a stage reads its weights and its sequences' KV once per step and does two
  operations per weight and token, at the device's peaks times its efficiencies; tensor parallelism
  adds two all-reduces a layer (ring: 2 (tp-1)/tp of the message over the link, plus its latency) and
  the gather of the logits' vocabulary shards, a row a sequence ((tp-1)/tp of them, plus its latency);
  a step passes every pipeline stage in turn, with pp batches in flight, so pipelining adds
  throughput, not speed for one sequence;
- with a workload (concurrent users, prompt and answer lengths, latency objectives): the largest
  batch a replica serves within the objectives, hence replicas, devices and cost. Each sequence
  brings its prompt's tokens along with its answer's, so a step's tokens are B x (1 + input / output).

Every figure is an estimate from published peaks and assumed efficiencies, except on the cpu device,
whose efficiencies are calibrated against `engine-run bench` on the machine Kiln is developed on.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from builder.targets import target
from dataclasses import asdict, dataclass, field, replace

from builder.planning.plan import Device, Plan, PlanError, load_devices, plan_from_dict
from builder.planning.shapes import (
    BATCHES,
    INT4_GROUP,
    PPS,
    TPS,
    WEIGHT_FORMATS,
    ModelShape,
    PlanningError,
    bytes_per_weight,
)
from runtime.format.kv_groups import (
    group_windows,
    shared_pools,
    window_blocks_per_sequence,
)
from runtime.format.engine_format import GIB
from runtime.format.mapping import Mapping
from runtime.format.memory_plan import RankMemoryPlan, workspace_bytes


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
    nodes: int = 1                                    # hosts the ranks are spread over, in order (node_of)
    problem: str | None = None                        # why it does not fit (None: it fits)
    weight_gib: float = 0.0                           # the fullest rank's
    workspace_gib: float = 0.0
    kv_gib: float = 0.0
    kv_tokens: int = 0
    kv_pools: tuple[int, ...] = ()                    # blocks of each KV group's pool (runtime/format/kv_groups.py)
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
    """Fill in the candidate's memory plan, roofline and (with users) sizing. Spread over c.nodes hosts, a tp group
    whose ranks are on two hosts and a pipeline hand-over between hosts go over the device's node link."""
    plan = c.plan
    # The cpu runtime gives windowed layers a pool of their own; the GPU backends one pool for all.
    windows = group_windows(model.layer_windows) if target(plan.target).WINDOWED_POOLS else (0,)
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
                                            model.vocab_size, target(plan.target).LIVE_ACTIVATIONS),
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
        compute, bandwidth = compute / (c.devices // c.nodes), bandwidth / (c.devices // c.nodes)
    within, between = Link(device.link_gbs, device.link_latency_us), Link(device.node_link_gbs,
                                                                        device.node_link_latency_us)
    tp_link = between if node_of(c, 0) != node_of(c, c.tp - 1) else within
    crossing = sum(node_of(c, s * c.tp) != node_of(c, (s + 1) * c.tp) for s in range(c.pp - 1))

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
            total += (2 * layers + 1) * allreduce(tp_link, c.tp, tokens * model.hidden_size * float_bytes)
            if vocab:  # the last stage's vocabulary shards gather a logits row a sequence
                total += allgather(tp_link, c.tp, sequences * model.vocab_size * float_bytes)
        handed = tokens * model.hidden_size * float_bytes
        total += (c.pp - 1 - crossing) * transfer(within, handed)
        return total + (crossing * transfer(between, handed) if crossing else 0.0)

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


class Link(NamedTuple):
    """What ranks exchange over: GB/s one way per device, and the time of one small message."""

    gbs: float
    latency_us: float


def node_of(c: Candidate, rank: int) -> int:
    """The host of a rank when c's ranks (tp ranks of a stage together, stage after stage) are spread evenly over
    c.nodes hosts in order."""
    return rank // (c.devices // c.nodes)


def allreduce(link: Link, tp: int, message: float) -> float:
    if tp == 1:
        return 0.0
    return link.latency_us * 1e-6 + 2 * (tp - 1) / tp * message / (link.gbs * 1e9)


def allgather(link: Link, tp: int, message: float) -> float:
    """Every rank ends with the whole `message`, each having held 1/tp of it."""
    if tp == 1:
        return 0.0
    return link.latency_us * 1e-6 + (tp - 1) / tp * message / (link.gbs * 1e9)


def transfer(link: Link, message: float) -> float:
    return link.latency_us * 1e-6 + message / (link.gbs * 1e9)


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
    nodes: int = 1                          # hosts the ranks are spread over

    @property
    def recommended(self) -> Candidate | None:
        ranked = [c for c in self.candidates if c.fits and (c.sizing is None or c.sizing["feasible"])]
        return ranked[0] if ranked else None

    def to_dict(self) -> dict:
        best = self.recommended
        return {"model": asdict(self.model), "workload": asdict(self.workload), "nodes": self.nodes,
                "candidates": [c.to_dict() for c in self.candidates],
                "unbuildable": [{"candidate": n, "why": w} for n, w in self.unbuildable],
                "recommended": best.to_dict() if best else None}


def plan_candidates(model: ModelShape, devices: list[str] | None = None, tps: list[int] | None = None,
                    pps: list[int] | None = None, weights: list[str] | None = None,
                    kv_dtypes: list[str] | None = None, workload: Workload | None = None,
                    prices: dict[str, float] | None = None, max_batch: int = 256, plan: Plan | None = None,
                    nodes: int = 1) -> Report:
    """Every candidate priced and ranked: fitting ones first; with users, those that meet the
    objectives, by cost (then devices); without, by decode tokens/s per device at the batch the KV
    cache holds. nodes: the ranks are spread over that many hosts (candidates whose ranks do not divide evenly
    among them are left out), talking between hosts over the devices' node link."""
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
    if nodes < 1:
        raise PlanningError(f"--nodes {nodes}: must be >= 1")
    if nodes > 1:
        unlinked = [n for n in names if not catalog[n].node_link_gbs]
        if unlinked:
            raise PlanningError(f"--nodes {nodes}: device {unlinked[0]!r} has no node link in plans/devices.toml "
                                "(node_link_gbs, node_link_latency_us)")
    if plan is not None and (plan.tp * plan.pp) % nodes:
        raise PlanningError(f"--nodes {nodes}: the plan's {plan.tp * plan.pp} ranks do not divide among {nodes} hosts")
    batches = [b for b in BATCHES if b <= max_batch]
    if plan is not None:  # one plan, priced as written
        c = Candidate(plan.device, plan.tp, plan.pp, plan.quant.method, plan.kv_cache.dtype, plan, nodes)
        price(model, c, catalog[plan.device], workload, [b for b in batches if b <= plan.limits.max_batch_size])
        return Report(model, workload, [c], [], nodes)
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
                        if (not tps and tp > device.gpus_per_node) or tp > model.num_heads or pp > model.num_layers \
                                or (tp * pp) % nodes:
                            continue
                        label = f"{name} tp={tp} pp={pp} {fmt} kv={kv}"
                        try:
                            plan = candidate_plan(device, tp, pp, fmt, kv, workload, max_batch,
                                                  bool(model.num_experts))
                        except PlanError as exc:
                            unbuildable.append((label, str(exc).split(": ", 1)[-1]))
                            continue
                        c = Candidate(name, tp, pp, fmt, kv, plan, nodes)
                        price(model, c, device, workload, batches)
                        candidates.append(c)
                        if c.fits and fitted_at is None:
                            fitted_at = pp
    candidates.sort(key=lambda c: _rank_key(c, catalog))
    return Report(model, workload, candidates, unbuildable, nodes)


def _rank_key(c: Candidate, catalog: dict[str, Device]) -> tuple:
    if not c.fits:
        return (2, c.device, c.weights, c.tp * c.pp)
    if c.sizing is not None:
        if not c.sizing["feasible"]:
            return (1, c.device, c.weights, c.tp * c.pp)
        return (0, c.sizing.get("usd_per_hour", math.inf), c.sizing["devices"])
    top = max(c.decode)
    return (0, -c.tokens_per_s(top) / c.devices, c.devices)


