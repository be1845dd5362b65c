"""Build plans: a TOML file validated once into frozen dataclasses; errors name the key and the fix.

The dataclass defaults are the default plan: plans/cpu.toml writes the same values out with their
reasons, and a plan file that leaves a key out gets the default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import tomllib

from builder.errors import KilnError
from builder.quant import methods
from builder.targets import TARGETS
from builder.targets import target as target_of
from runtime.format.engine_format import KV_CACHE_DTYPES

KV_DTYPES = tuple(KV_CACHE_DTYPES)
QUANT_METHODS = methods.NAMES
GROUP_SIZES = (32, 64, 128)
ACTIVATIONS = ("f32", "int16", "int12", "int8", "auto", "f16", "bf16")
# What each target takes (activations, KV dtypes, quant methods) is the target's own: builder/targets.
BF16_MIN_CC = (8, 0)  # bf16 tensor cores: Ampere or newer
FP8_MIN_CC = (8, 9)   # FP8 tensor cores: Ada, Hopper or newer
ROUNDINGS = ("gptq", "nearest")


class PlanError(KilnError):
    """An invalid plan; the message names the key."""


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    memory_gib: float
    bandwidth_gbs: float
    fp8: bool
    fp8_storage: bool
    arch: str | None = None                # GPUs: CUDA arch, "sm_89"
    compute_capability: str | None = None  # GPUs: "8.9", the same number as arch
    # What the planner reads (plans/devices.toml explains each; builder/planning/planner.py uses them)
    tflops_16: float = 0.0                 # dense fp16/bf16 tensor TFLOPS (cpu: its f32 peak)
    tflops_fp8: float = 0.0
    tops_int8: float = 0.0
    interconnect: str = "none"
    link_gbs: float = 0.0                  # one direction, per device
    link_latency_us: float = 0.0           # one small all-reduce
    gpus_per_node: int = 1
    node_link_gbs: float = 0.0             # between nodes (hosts): one direction, per device; 0: none known
    node_link_latency_us: float = 0.0      # one small all-reduce between nodes
    bandwidth_efficiency: float = 0.7
    compute_efficiency: float = 0.5
    price_per_hour: float | None = None    # USD

    @property
    def cc(self) -> tuple[int, int] | None:
        """The compute capability as (major, minor), for comparisons; None for CPUs."""
        if self.compute_capability is None:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)


@dataclass(frozen=True)
class Limits:
    max_batch_size: int = 32
    max_num_tokens: int = 512
    max_seq_len: int = 2048


@dataclass(frozen=True)
class KVCache:
    dtype: str = "f16"
    block_size: int = 16
    memory_fraction: float = 0.5


@dataclass(frozen=True)
class Quant:
    method: str = "source"
    group_size: int = 32
    exclude: tuple[str, ...] = ("*lm_head*", "embed_tokens")
    calib: str | None = None
    max_ppl_increase: float | None = None
    min_greedy_agreement: float | None = None  # percent of the shipped chat prompts answered as the reference
    # cpu: auto (every path measured; the serving host runs the fastest the accuracy gate allows), or f32, int16,
    # int12, int8 alone (int4/int8 linears quantize activations per token and block); tensorrt: f16, bf16
    # (compute capability 8.0+) or f32. Unset in a plan file, it is the target's first choice (cpu: auto).
    activations: str = "auto"
    rounding: str = "gptq"    # int4-awq: gptq (grids fitted, rounding errors compensated) or nearest (AWQ clip)


@dataclass(frozen=True)
class Plan:
    target: str = "cpu"
    device: str = "cpu"
    tp: int = 1
    pp: int = 1
    # expert parallelism: the ranks of a stage a mixture's experts are split between, whole experts each (uneven
    # counts allowed); 1 or tp, or > 1 with tp = 1 (attention then runs whole on each of the ep ranks). With
    # ep = 1 and tp > 1 every expert is split by its intermediate columns, as a dense MLP is.
    ep: int = 1
    limits: Limits = field(default_factory=Limits)
    kv_cache: KVCache = field(default_factory=KVCache)
    quant: Quant = field(default_factory=Quant)

    @property
    def group(self) -> int:
        """Ranks a pipeline stage has: tp, or ep where the experts alone are split."""
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.group * self.pp

    def to_dict(self) -> dict:
        """Plain JSON types (lists, not tuples), as stored in the manifest."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def with_overrides(self, section: str | None = None, **changes) -> Plan:
        """A new validated plan with some keys changed (CLI flags); None values are ignored."""
        doc = self.to_dict()
        target = doc[section] if section else doc
        target.update({k: v for k, v in changes.items() if v is not None})
        return plan_from_dict(doc, "command line")


def default_plan_path() -> Path:
    return Path(str(resources.files("plans") / "cpu.toml"))


def load_devices() -> dict[str, Device]:
    doc = tomllib.loads((resources.files("plans") / "devices.toml").read_text())
    return {name: Device(name=name, **spec) for name, spec in doc.items()}


def load_plan(path: str | Path | None = None) -> Plan:
    path = Path(path) if path is not None else default_plan_path()
    if not path.is_file():
        raise PlanError(f"plan {path}: no such file")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"plan {path}: not valid TOML: {exc}") from None
    return plan_from_dict(doc, str(path))


def plan_from_dict(doc: dict, origin: str) -> Plan:
    sections = {"limits": Limits, "kv_cache": KVCache, "quant": Quant}
    top = _take(Plan, {k: v for k, v in doc.items() if k not in sections}, origin, "")
    for key, cls in sections.items():
        value = doc.get(key, {})
        if not isinstance(value, dict):
            raise PlanError(f"plan {origin}: [{key}] must be a table")
        top[key] = cls(**_take(cls, value, origin, f"[{key}] "))
    if "activations" not in doc.get("quant", {}) and top.get("target") in TARGETS:  # the target's first choice
        top["quant"] = dataclasses.replace(top["quant"], activations=target_of(top["target"]).ACTIVATIONS[0])
    plan = Plan(**top)
    _validate(plan, origin)
    return plan


def _take(cls, values: dict, origin: str, where: str) -> dict:
    """Keep known keys with the right types; refuse unknown keys naming them."""
    known = {f.name: f for f in fields(cls) if f.name not in ("limits", "kv_cache", "quant")}
    out = {}
    for key, value in values.items():
        if key not in known:
            raise PlanError(f"plan {origin}: unknown key {where}{key!r} (known: {', '.join(known)})")
        default = known[key].default
        if default is dataclasses.MISSING:
            default = known[key].default_factory()
        out[key] = _coerce(value, default, f"plan {origin}: {where}{key}")
    return out


def _coerce(value, default, where: str):
    if value is None and default is None:  # optional keys written back by Plan.to_dict()
        return None
    if isinstance(default, bool) or (default is None and isinstance(value, bool)):
        if not isinstance(value, bool):
            raise PlanError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise PlanError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float) or (default is None and isinstance(value, (int, float))):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanError(f"{where} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise PlanError(f"{where} must be a string, got {value!r}")
    return value


def _validate(plan: Plan, origin: str) -> None:
    def fail(key: str, problem: str) -> None:
        raise PlanError(f"plan {origin}: {key} {problem}")

    devices = load_devices()
    if plan.target not in TARGETS:
        fail("target", f"must be one of {', '.join(TARGETS)}, got {plan.target!r}")
    if plan.device not in devices:
        fail("device", f"{plan.device!r} is not in the catalog (known: {', '.join(devices)})")
    device = devices[plan.device]
    target = target_of(plan.target)
    if device.kind != target.DEVICE_KIND:
        needs = "a GPU device from the catalog" if target.DEVICE_KIND == "gpu" else 'device = "cpu"'
        fail("device", f"{plan.device!r} is a {device.kind.upper()}; the {plan.target} target needs {needs}")
    if device.kind == "gpu" and device.cc is None:
        fail("device", f"{plan.device} has no compute_capability in plans/devices.toml")
    for key in ("tp", "pp", "ep"):
        if getattr(plan, key) < 1:
            fail(key, f"must be >= 1, got {getattr(plan, key)}")
    if plan.ep > 1 and plan.tp not in (1, plan.ep):
        fail("ep", f"must be 1, tp ({plan.tp}) or any count with tp = 1, got {plan.ep}")
    for key in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        if getattr(plan.limits, key) < 1:
            fail(f"[limits] {key}", f"must be >= 1, got {getattr(plan.limits, key)}")
    if plan.limits.max_num_tokens < plan.limits.max_batch_size:
        fail("[limits] max_num_tokens", "must be at least max_batch_size (one decode token per sequence)")
    kv = plan.kv_cache
    gpu = device.kind == "gpu"
    cc = f"{plan.device} is {device.compute_capability}"
    if kv.dtype not in KV_DTYPES:
        fail("[kv_cache] dtype", f"must be one of {', '.join(KV_DTYPES)}, got {kv.dtype!r}")
    target.check_plan(plan, device, fail)  # the target's own constraints, with its reasons, before the generic ones
    if kv.dtype not in target.KV_DTYPES:
        takers = [name for name in TARGETS if kv.dtype in target_of(name).KV_DTYPES]
        why = f" (a {' and '.join(takers)}-only KV cache)" if takers else ""
        fail("[kv_cache] dtype", f"{kv.dtype} cannot be built for the {plan.target} target{why}; it takes "
                                 f"{', '.join(target.KV_DTYPES)}: use dtype = \"{target.KV_DTYPES[0]}\"")
    if kv.block_size < 1 or kv.block_size & (kv.block_size - 1):
        fail("[kv_cache] block_size", f"must be a power of two, got {kv.block_size}")
    if not 0 < kv.memory_fraction <= 1:
        fail("[kv_cache] memory_fraction", f"must be in (0, 1], got {kv.memory_fraction}")
    q = plan.quant
    if q.method not in QUANT_METHODS:
        fail("[quant] method", f"must be one of {', '.join(QUANT_METHODS)}, got {q.method!r}")
    if q.method not in target.QUANT_METHODS:
        fail("[quant] method", f"{q.method} is not available on the {plan.target} target "
                               f"(it takes {', '.join(target.QUANT_METHODS)})")
    if q.group_size not in GROUP_SIZES:
        fail("[quant] group_size", f"must be one of {GROUP_SIZES}, got {q.group_size}")
    if gpu:  # the tensorrt target computes FP8 on tensor cores: storing it is not enough
        if q.method == "fp8" and device.cc < FP8_MIN_CC:
            fail("[quant] method", f"fp8 needs FP8 tensor cores (compute capability 8.9+); {cc}")
        if kv.dtype == "fp8" and device.cc < FP8_MIN_CC:
            fail("[kv_cache] dtype", f"fp8 needs FP8 tensor cores (compute capability 8.9+); {cc}")
        if kv.dtype == "bf16" and device.cc < BF16_MIN_CC:
            fail("[kv_cache] dtype", f"bf16 needs compute capability 8.0+; {cc}: use dtype = \"f16\"")
    else:
        if q.method == "fp8" and not (device.fp8 or device.fp8_storage):
            fail("[quant] method", f"fp8 needs a device with FP8 (Ada/Hopper or newer); {plan.device} has none")
        if kv.dtype == "fp8" and not (device.fp8 or device.fp8_storage):
            fail("[kv_cache] dtype", f"fp8 needs a device with FP8 (Ada/Hopper or newer); {plan.device} has none")
    if q.activations not in ACTIVATIONS:
        fail("[quant] activations", f"must be one of {', '.join(ACTIVATIONS)}, got {q.activations!r}")
    if q.activations not in target.ACTIVATIONS:
        takes = " or ".join(target.ACTIVATIONS)
        what = ("auto chooses among the cpu kernel paths" if q.activations == "auto"
                else f"{q.activations} is a cpu kernel path (integer activations per token)")
        fail("[quant] activations", f"{what}; the {plan.target} target takes {takes}: use activations = "
                                    f"\"{target.ACTIVATIONS[0]}\"")
    if q.activations == "bf16" and gpu and device.cc < BF16_MIN_CC:
        fail("[quant] activations", f"bf16 needs compute capability 8.0+; {cc}: use activations = \"f16\"")
    if q.rounding not in ROUNDINGS:
        fail("[quant] rounding", f"must be one of {', '.join(ROUNDINGS)}, got {q.rounding!r}")
    if q.max_ppl_increase is not None and q.max_ppl_increase < 0:
        fail("[quant] max_ppl_increase", f"must be >= 0 (a percentage), got {q.max_ppl_increase}")
    if q.min_greedy_agreement is not None and not 0 <= q.min_greedy_agreement <= 100:
        fail("[quant] min_greedy_agreement", f"must be between 0 and 100 (a percentage), got {q.min_greedy_agreement}")
