"""Prometheus metrics of a server: per model (latency histograms, queue depth, KV and prefix-cache use, token
counts), and for the endpoint (HTTP errors, per-key usage and limits, tiered routing). /metrics shows every model's
series with a `model` label."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from runtime.core.engine import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """One model's metrics in a registry of their own (so several models and servers can live in one process).

    Latencies are observed by the engine thread as each step's tokens come out: TTFT from the
    moment the HTTP handler received the request, inter-token latency between a request's tokens.
    """

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "kiln_time_to_first_token_seconds", "Request arrival to its first generated token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "kiln_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
            buckets=ITL_BUCKETS, registry=r)
        self.requests_running = Gauge("kiln_num_requests_running", "Sequences holding KV blocks.", registry=r)
        self.requests_waiting = Gauge("kiln_num_requests_waiting", "Sequences queued for admission.", registry=r)
        self.kv_cache_usage = Gauge("kiln_kv_cache_usage_ratio", "Fraction of KV blocks held by sequences.",
                                    registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "kiln_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up, "
            "since start.", registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("kiln_num_preemptions", "Sequences preempted for lack of KV blocks.", registry=r)
        self.spec_proposed = Counter("kiln_spec_proposed_tokens", "Speculative guesses verified.", registry=r)
        self.spec_accepted = Counter("kiln_spec_accepted_tokens", "Speculative guesses that stood.", registry=r)
        self.spec_acceptance = Gauge("kiln_spec_acceptance_rate", "Speculative guesses that stood / guesses "
                                     "verified, since start (0 before any).", registry=r)
        self.spec_tokens_per_step = Gauge(
            "kiln_spec_tokens_per_step", "Tokens a speculating sequence gained per step, since start (1 before "
            "any: one token per step is decoding without speculation).", registry=r)
        self.requests_finished = Counter("kiln_requests_finished", "Engine requests finished, by reason.",
                                         ["finish_reason"], registry=r)
        self.requests_restarted = Counter("kiln_requests_restarted", "Requests started again on another replica "
                                          "after theirs failed (replicas only).", registry=r)
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0)

    def update(self, stats: EngineStats) -> None:
        """Set the gauges from the engine's stats and advance the counters by what changed since last time."""
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)
        last = self._last
        self.prompt_tokens.inc(stats.prompt_tokens - last.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens - last.generated_tokens)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.spec_proposed.inc(stats.spec_proposed_tokens - last.spec_proposed_tokens)
        self.spec_accepted.inc(stats.spec_accepted_tokens - last.spec_accepted_tokens)
        self.spec_acceptance.set(stats.spec_acceptance_rate)
        self.spec_tokens_per_step.set(stats.spec_tokens_per_step)
        self._last = stats

    def refresh(self) -> None:
        """Bring gauges that are read on demand up to date before a scrape (replica_metrics.ReplicaMetrics)."""


class FrontMetrics:
    """The endpoint's own metrics, and its models' under a `model` label, in one registry for /metrics."""

    def __init__(self, models: dict[str, ServerMetrics]):
        self.models = models
        self.registry = r = CollectorRegistry()
        self.http_errors = Counter("kiln_http_errors", "Requests answered with an error, by HTTP status.",
                                   ["status"], registry=r)
        self.key_requests = Counter("kiln_key_requests", "Generation requests started, by API key name and the model answering.",
                                    ["key", "model"], registry=r)
        self.key_prompt_tokens = Counter("kiln_key_prompt_tokens", "Prompt tokens of admitted requests, by API key "
                                         "name.", ["key"], registry=r)
        self.key_generation_tokens = Counter("kiln_key_generation_tokens", "Tokens generated, by API key name.",
                                             ["key"], registry=r)
        self.key_rate_limited = Counter("kiln_key_rate_limited", "Requests refused with 429 for a key's limit, by "
                                        "API key name and limit (rpm, tpm).", ["key", "limit"], registry=r)
        self.tier_answers = Counter("kiln_tier_requests", "Requests for a tier, by tier and the model that "
                                    "answered.", ["tier", "model"], registry=r)
        self.tier_escalations = Counter("kiln_tier_escalations", "Tier requests moved to a stronger model, by tier, "
                                        "the model left and why (confidence, prompt_length, header, unavailable).",
                                        ["tier", "model", "reason"], registry=r)
        r.register(_ByModel(models))

    def render(self) -> tuple[bytes, str]:
        for metrics in self.models.values():
            metrics.refresh()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ByModel:
    """A collector of every model's series, each with a `model` label, one family per metric name."""

    def __init__(self, models: dict[str, ServerMetrics]):
        self.models = models

    def collect(self):
        families: dict[str, Metric] = {}
        for model, metrics in self.models.items():
            for family in metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(s._replace(labels={"model": model, **s.labels}) for s in family.samples)
        yield from families.values()
