"""What one endpoint serves: engines by model name (each with its own replicas) and tiers that route between them.

`engine-run serve A B` serves two engines under their manifests' model names (`name=DIR` names one); a fleet
file says more, per model:

    [[models]]
    name = "smollm2-fast"          # what clients send as "model"
    engine = "engines/fast"        # relative to this file
    replicas = 2                   # also max_replicas, routing, spread, nnodes, disaggregate, threads, kv_cache_gib,
                                   # backend

    [[models]]
    name = "smollm2"
    engine = "engines/exact"

    [tiers.auto]                   # "model": "auto" starts on the first model and may escalate to the next
    models = ["smollm2-fast", "smollm2"]
    probe_tokens = 8               # the cheap model's first tokens, held back while it is judged
    min_mean_logprob = -1.0        # escalate when their mean log-probability is below this
    confidence = "mean"            # or "min": judge the least likely of those tokens instead of their mean
    max_prompt_tokens = 1024       # longer prompts start on the last model

A model is served from this process (replicas = 1) or, when any model needs Ray Serve (replicas, autoscaling,
disaggregation, a cluster), every model is a Serve deployment of its own behind one ingress.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.backends import open_engine

if TYPE_CHECKING:
    from runtime.core.engine import EngineOptions

ROUTING_POLICIES = ("prefix", "round-robin")
HEALTH_CHECK_PERIOD_S = 2.0
MODEL_KEYS = {"name", "engine", "replicas", "max_replicas", "routing", "spread", "nnodes", "disaggregate",
              "threads", "kv_cache_gib", "backend"}
TIER_KEYS = {"models", "probe_tokens", "min_mean_logprob", "max_prompt_tokens", "confidence"}
CONFIDENCE_RULES = ("mean", "min")


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, and how they are routed and checked."""

    replicas: int = 2
    max_replicas: int | None = None  # above `replicas`: autoscale between the two on in-flight requests
    routing: str = "prefix"
    health_check_period_s: float = HEALTH_CHECK_PERIOD_S
    prefill_replicas: int = 0        # disaggregated: this many prefill workers, and `replicas` decode workers
    spread: bool = False             # at most one of the model's replicas (of each role) on a Ray node
    nnodes: int = 1                  # Ray nodes each replica's ranks spread over (a placement group, STRICT_SPREAD)

    @classmethod
    def disaggregated(cls, spec: str, **fields) -> ReplicaPlan:
        """From --disaggregate P:D."""
        p, sep, d = spec.partition(":")
        if not (sep and p.strip().isdigit() and d.strip().isdigit() and int(p) >= 1 and int(d) >= 1):
            raise ValueError(f"--disaggregate {spec!r}: expected P:D, prefill and decode workers, e.g. 1:1")
        return cls(replicas=int(d), prefill_replicas=int(p), **fields)

    @property
    def num_engines(self) -> int:
        return self.replicas + self.prefill_replicas

    def __post_init__(self) -> None:
        if self.prefill_replicas and self.max_replicas is not None:
            raise ValueError("--max-replicas autoscales colocated replicas; it cannot be combined with --disaggregate")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.nnodes > 1 and self.prefill_replicas:
            raise ValueError("--disaggregate hands K/V between one-rank engines; it cannot be combined with --nnodes")
        if self.nnodes > 1 and self.spread:
            raise ValueError("--nnodes already puts each replica's hosts on separate nodes; leave out --spread "
                             "(Ray Serve cannot combine the two)")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing {self.routing!r}: choose one of {', '.join(ROUTING_POLICIES)}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One engine behind the endpoint, under the name clients send."""

    name: str
    engine: Path
    plan: ReplicaPlan = ReplicaPlan(replicas=1)
    threads: int | None = None          # None: the command line's, else the host's cores shared out
    kv_cache_gib: float | None = None
    backend: str | None = None

    @property
    def on_ray(self) -> bool:
        return (self.plan.replicas > 1 or self.plan.max_replicas is not None or self.plan.prefill_replicas > 0
                or self.plan.nnodes > 1)


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """A model name that starts a request on the cheapest of `models` and escalates by a stated rule: the cheap
    model's mean log-probability over its first `probe_tokens` tokens (confidence "min": the lowest of them)
    below `min_mean_logprob`, or a prompt of more than `max_prompt_tokens` tokens (straight to the last
    model)."""

    name: str
    models: tuple[str, ...]
    probe_tokens: int = 8
    min_mean_logprob: float = -1.0
    max_prompt_tokens: int | None = None
    confidence: str = "mean"

    def __post_init__(self) -> None:
        if len(self.models) < 2 or len(set(self.models)) != len(self.models):
            raise ValueError(f"tier {self.name!r}: models must name two or more different models, cheapest first")
        if self.probe_tokens < 1:
            raise ValueError(f"tier {self.name!r}: probe_tokens must be >= 1, got {self.probe_tokens}")
        if not math.isfinite(self.min_mean_logprob) or self.min_mean_logprob > 0:
            raise ValueError(f"tier {self.name!r}: min_mean_logprob must be a log-probability (<= 0), got "
                             f"{self.min_mean_logprob}")
        if self.confidence not in CONFIDENCE_RULES:
            raise ValueError(f"tier {self.name!r}: confidence must be one of {', '.join(CONFIDENCE_RULES)}, got "
                             f"{self.confidence!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"tier {self.name!r}: max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclasses.dataclass(frozen=True)
class Fleet:
    models: tuple[ModelSpec, ...]
    tiers: tuple[TierSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("nothing to serve: give an engine directory or a fleet file")
        names = [m.name for m in self.models]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"model name {name!r} is given to two engines; name them apart (NAME=DIR)")
        for tier in self.tiers:
            if tier.name in names:
                raise ValueError(f"tier {tier.name!r} has the name of a model")
            unknown = [m for m in tier.models if m not in names]
            if unknown:
                raise ValueError(f"tier {tier.name!r} names {', '.join(map(repr, unknown))}, not served here "
                                 f"(models: {', '.join(names)})")

    @property
    def on_ray(self) -> bool:
        return any(m.on_ray for m in self.models)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]


def model_options(model: ModelSpec, options: EngineOptions) -> EngineOptions:
    """The command line's engine options with what the fleet file sets for this model."""
    changes = {"num_threads": model.threads, "kv_cache_gib": model.kv_cache_gib, "backend": model.backend}
    return dataclasses.replace(options, **{k: v for k, v in changes.items() if v is not None})


def model_name_of(engine: Path) -> str:
    return open_engine(engine, check_hashes=False).manifest.model_name


def from_arguments(engines: list[str], model_name: str | None, plan: ReplicaPlan) -> Fleet:
    """`engine-run serve DIR [NAME=DIR ...]`: the command line's replica plan for every engine."""
    if model_name is not None and len(engines) > 1:
        raise ValueError("--model-name names one engine; with several, write NAME=DIR for each")
    models = []
    for arg in engines:
        name, sep, directory = arg.partition("=")
        if not sep or "/" in name or not name:
            name, directory = (model_name or ""), arg
        path = Path(directory)
        models.append(ModelSpec(name or model_name_of(path), path, plan))
    return Fleet(tuple(models))


def load_fleet(path: Path) -> Fleet:
    """A fleet file (the module docstring's format); one-line ValueErrors for what it gets wrong."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"fleet file {path}: unreadable ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"fleet file {path}: not TOML ({exc})") from None
    unknown = set(data) - {"models", "tiers"}
    if unknown or not isinstance(data.get("models"), list):
        raise ValueError(f"fleet file {path}: expected [[models]] tables (and optional [tiers.NAME]); "
                         f"{'unknown ' + ', '.join(sorted(unknown)) if unknown else 'no [[models]]'}")
    models = []
    for i, entry in enumerate(data["models"]):
        where = f"fleet file {path}: models[{i}]"
        extra = set(entry) - MODEL_KEYS
        if extra:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(extra))} (known: "
                             f"{', '.join(sorted(MODEL_KEYS))})")
        if "engine" not in entry:
            raise ValueError(f"{where}: engine = DIR is required")
        engine = (Path(path).parent / entry["engine"]).resolve()
        disaggregate = entry.get("disaggregate")
        fields = {"max_replicas": entry.get("max_replicas"), "routing": entry.get("routing", "prefix"),
                  "spread": bool(entry.get("spread", False)), "nnodes": entry.get("nnodes", 1)}
        try:
            plan = (ReplicaPlan.disaggregated(disaggregate, **fields) if disaggregate is not None
                    else ReplicaPlan(replicas=int(entry.get("replicas", 1)), **fields))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        models.append(ModelSpec(entry.get("name") or model_name_of(engine), engine, plan, entry.get("threads"),
                                entry.get("kv_cache_gib"), entry.get("backend")))
    tiers = []
    for name, entry in (data.get("tiers") or {}).items():
        extra = set(entry) - TIER_KEYS
        if extra or "models" not in entry:
            raise ValueError(f"fleet file {path}: tiers.{name}: models = [cheapest, ..., strongest] is required"
                             + (f"; unknown key(s) {', '.join(sorted(extra))}" if extra else ""))
        try:
            tiers.append(TierSpec(name, tuple(entry["models"]), int(entry.get("probe_tokens", 8)),
                                  float(entry.get("min_mean_logprob", -1.0)), entry.get("max_prompt_tokens"),
                                  entry.get("confidence", "mean")))
        except ValueError as exc:
            raise ValueError(f"fleet file {path}: {exc}") from None
    try:
        return Fleet(tuple(models), tuple(tiers))
    except ValueError as exc:
        raise ValueError(f"fleet file {path}: {exc}") from None
