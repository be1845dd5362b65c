"""`engine-run serve --replicas N`: N engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

    client --HTTP--> Ray Serve proxy --> KilnIngress (the same FastAPI app as one engine serves)
                                              | DeploymentHandle, routed by KilnRouter
                                              v
                        KilnReplica x N: an EngineLoop each, its own LLMEngine and rank processes

KilnIngress reads prompts (tokenizer and chat template, loaded from the engine directory) and hands
each request's token ids to `KilnReplica.generate` as a streaming handle call. The handle's router,
KilnRouter, runs in the ingress process: it sees the token ids in the call's kwargs and picks a
replica with routing.PrefixAwareRouter (the replica most likely to hold the prompt's leading blocks
in its prefix cache, balanced against the replicas' in-flight requests), or round-robin.

ReplicaPool gives the ingress the EngineLoop interface api.py and app.py already serve from
(submit / abort / ready / metrics), so the API, streaming and error shapes are those of one engine.
A replica whose process or engine dies fails the requests it was running (each gets a clean
"generation failed" error); a request refused before it started anywhere is sent to another
replica. Serve's health check (KilnReplica.check_health: the engine thread is alive) replaces the
replica. Replicas report their load, prefix-cache hits and process memory through
`record_routing_stats`; the ingress's /metrics shows them per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.engine import EngineOptions, RequestOutput
from runtime.engine_format import open_engine
from runtime.sampling import SamplingParams
from runtime.serving.engine_loop import ABORTED, EngineLoop, Overloaded
from runtime.serving.fleet import ReplicaPlan  # noqa: F401 (where it was)
from runtime.serving.fleet import Fleet, ModelSpec, model_options
from runtime.serving.metrics import ServerMetrics
from runtime.serving.protocol import APIError

if TYPE_CHECKING:
    from runtime.serving.auth import ApiKeys

log = logging.getLogger("kiln.replicas")

APP_NAME = "kiln"
ROUTING_STATS_PERIOD_S = 1.0


@dataclasses.dataclass(frozen=True)
class Refused:
    """A replica's answer to a request it did not start: what the client gets, unless another replica may
    take it (retry: the replica's engine is not serving)."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry: bool = False

    def error(self) -> APIError:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return APIError(self.status, self.message, self.type, self.param, self.code, headers)


# ------------------------------------------------------------------------------------------ replica

class KilnReplica:
    """One engine (its EngineLoop, LLMEngine and rank processes) as a Ray Serve replica."""

    async def __init__(self, engine: str, options: EngineOptions, max_waiting: int):
        from runtime.launcher import open_llm_engine

        self.engine_loop = EngineLoop(lambda: open_llm_engine(engine, options), max_waiting)
        loop = asyncio.get_running_loop()
        settled = loop.create_future()

        def settle() -> None:
            if not settled.done():
                settled.set_result(None)

        self.engine_loop.start(loop, on_ready=lambda: loop.call_soon_threadsafe(settle),
                               on_exit=lambda: loop.call_soon_threadsafe(settle))
        await settled
        if not self.engine_loop.ready:  # Serve reports the constructor's error and retries it
            raise RuntimeError(f"the engine did not start: {self.engine_loop.failure}")
        self._cpu_seconds = (time.monotonic(), _cpu_seconds())

    def describe(self) -> dict:
        """What the ingress needs to read prompts for this engine."""
        from runtime.serving.prompts import context_len

        llm = self.engine_loop.llm
        return {"context_len": context_len(llm), "num_blocks": llm.num_blocks, "block_size": llm.block_size}

    async def generate(self, requests: list[tuple[str, list[int], SamplingParams]], token_ids: list[int] = (),
                       hand_off: bool = False, handoffs: dict | None = None):
        """Stream a request's outputs: first [] once the engine took it (or one Refused), then lists of
        RequestOutput as steps produce them. `token_ids` is for the router, which reads the call's kwargs.
        Disaggregated: hand_off prefills only (the final outputs carry the K/V), handoffs decodes from them."""
        if not self.engine_loop.ready:  # its engine thread ended (a rank died): until Serve replaces it
            yield Refused(503, f"replica unavailable: {self.engine_loop.failure}", "unavailable", retry=True)
            return
        try:
            outputs = await self.engine_loop.submit(requests, time.monotonic(), hand_off, handoffs)
        except Overloaded:
            yield Refused(429, f"the server is at capacity ({self.engine_loop.max_waiting} requests waiting per "
                               "replica); retry later", "rate_limit_error", code="queue_full")
            return
        except APIError as exc:
            yield Refused(exc.status, exc.message, exc.type, exc.param, exc.code)
            return
        except Exception as exc:  # another replica may take the request
            yield Refused(503, f"replica unavailable: {type(exc).__name__}: {exc}", "unavailable", retry=True)
            return
        yield []
        unfinished = {rid for rid, _, _ in requests}
        try:
            while unfinished:
                batch = [await outputs.get()]
                while not outputs.empty():
                    batch.append(outputs.get_nowait())
                if ABORTED in batch:
                    yield Refused(503, "the replica shut down before this request finished", "unavailable")
                    return
                unfinished.difference_update(out.request_id for out in batch if out.finished)
                yield batch
        finally:  # the ingress cancelled the call (its client left): free the blocks
            self.engine_loop.abort(list(unfinished))

    def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        if not self.engine_loop.ready:
            raise RuntimeError(f"the engine stopped: {self.engine_loop.failure}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Load, cache and process figures; the router and the ingress's /metrics read them."""
        llm = self.engine_loop.llm
        stats = llm.stats() if llm is not None and self.engine_loop.ready else None
        now, cpu = time.monotonic(), _cpu_seconds()
        then, cpu_then = self._cpu_seconds
        self._cpu_seconds = (now, cpu)
        figures = {"pid": os.getpid(), "rss_bytes": _rss_bytes(), "healthy": self.engine_loop.ready,
                   "cpu_utilisation": (cpu - cpu_then) / (now - then) if now > then else 0.0}
        if stats is not None:
            figures.update(running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_usage,
                           prefix_queries=stats.prefix_queries, prefix_hits=stats.prefix_hits,
                           preemptions=stats.num_preemptions)
        figures.update(_gpu_figures())
        return figures

    def __del__(self) -> None:
        self.engine_loop.stop()


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (rank processes included once they end)."""
    usage = os.times()
    return usage.user + usage.system + usage.children_user + usage.children_system


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gpu_figures() -> dict:
    """GPU memory and utilisation from NVML where a GPU and nvidia-ml-py are present; nothing otherwise."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    figures = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else range(
        pynvml.nvmlDeviceGetCount())
    for i in indices:
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        figures[f"gpu{i}_memory_used_bytes"] = memory.used
        figures[f"gpu{i}_utilisation"] = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
    return figures


# ------------------------------------------------------------------------------------------ ingress

class ModelFrontend:
    """What the API reads prompts with (LLMEngine's tokenizer, chat template, limits), without an engine:
    the files come from the engine directory, the KV pool's size from a replica."""

    def __init__(self, engine: str, options: EngineOptions, described: dict):
        from types import SimpleNamespace

        from tokenizers import Tokenizer

        from runtime.engine import _read_json
        from runtime.special_tokens import from_tokenizer

        self.engine = open_engine(engine, check_hashes=False, backend=options.backend)
        path = Path(engine)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer_config = _read_json(path / "tokenizer_config.json")
        self.special_tokens = self.engine.manifest.special_tokens or from_tokenizer(self.tokenizer_config,
                                                                                    self.tokenizer)
        self.eos_token_ids = self.engine.manifest.eos_token_ids
        self.block_size = described["block_size"]
        self.num_blocks = described["num_blocks"]
        self.context_len = described["context_len"]  # what prompts.context_len gives for the replica's engine
        self.limits = SimpleNamespace(max_seq_len=described["context_len"])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from runtime.chat import render_chat

        return render_chat(self.tokenizer_config, messages, add_generation_prompt)


class ReplicaPool:
    """The ingress's side of the replicas, with the EngineLoop interface that api.py and app.py serve from."""

    RETRIES = 3  # a request no replica started is offered to another this many times

    def __init__(self, handle, frontend: ModelFrontend, max_waiting: int, metrics: ServerMetrics, prefill=None,
                 expected_replicas: int = 1):
        self.handle = handle.options(stream=True)
        self.prefill = prefill.options(stream=True) if prefill is not None else None  # disaggregated
        self.llm = frontend
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.expected_replicas = expected_replicas
        self._started = False
        self.failure: Exception | None = None
        self._calls: dict[str, asyncio.Task] = {}  # request id -> the task pumping its call's outputs

    @property
    def ready(self) -> bool:
        """Serving (/health 200) once the router has seen every replica the plan starts with; it stays so
        while Serve replaces one that dies."""
        if not self._started:
            from runtime.serving.ray_router import replica_figures

            self._started = len(replica_figures(self.metrics.model)) >= self.expected_replicas
        return self._started

    @property
    def num_unfinished(self) -> int:
        return len(self._calls)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]], arrival: float) -> asyncio.Queue:
        outputs: asyncio.Queue = asyncio.Queue()
        ids = [rid for rid, _, _ in requests]
        last_token: dict[str, float] = {}
        if self.prefill is None:
            call = await self._start(self.handle, requests)
        else:  # prefill workers give the first token and the K/V; decode workers go on from there
            first = await self._prefill(requests)
            now = time.monotonic()
            decoding = []
            for request in requests:
                out = first[request[0]]
                done = out.finish_reason != "length" or request[2].max_tokens <= 1 or out.kv_handoff is None
                self._observe(out if done else dataclasses.replace(out, finished=False), now, arrival, last_token)
                outputs.put_nowait(dataclasses.replace(out, kv_handoff=None, finished=done,
                                                       finish_reason=out.finish_reason if done else None))
                if not done:
                    decoding.append(request)
            if not decoding:
                return outputs
            handoffs = {rid: first[rid].kv_handoff for rid, _, _ in decoding}
            call = await self._start(self.handle, decoding, handoffs=handoffs)
            ids = [rid for rid, _, _ in decoding]
        task = asyncio.get_running_loop().create_task(self._pump(call, ids, outputs, arrival, last_token))
        self._calls.update(dict.fromkeys(ids, task))
        return outputs

    async def _prefill(self, requests) -> dict[str, RequestOutput]:
        """Each request's final output from a prefill worker: its first token, and its K/V to hand over."""
        call = await self._start(self.prefill, requests, hand_off=True)
        final: dict[str, RequestOutput] = {}
        try:
            async for batch in call:
                if isinstance(batch, Refused):
                    raise batch.error()
                final.update((out.request_id, out) for out in batch if out.finished)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except APIError:
            raise
        except Exception as exc:
            raise APIError(500, f"generation failed: the prefill worker running it failed ({type(exc).__name__})",
                           type="server_error") from None
        errors = [out.error for out in final.values() if out.finish_reason == "error"]
        if errors:
            raise APIError(500, f"generation failed: {errors[0]}", type="server_error")
        return final

    async def _start(self, handle, requests, **kwargs):
        """A streaming generate call that a replica has started (its first item, [], consumed); a replica
        that refuses for want of an engine, or dies before answering, passes the request to another."""
        refused = None
        for _ in range(self.RETRIES):
            call = handle.generate.remote(requests, token_ids=requests[0][1], **kwargs)
            try:
                first = await call.__anext__()
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # the replica died before answering: nothing started
                log.warning("a replica failed before starting a request (%s); trying another", exc)
                refused = Refused(503, f"no replica could take the request: {type(exc).__name__}", "unavailable")
                continue
            if isinstance(first, Refused):
                refused = first
                if first.retry:
                    continue
                raise first.error()
            break
        else:
            raise refused.error()
        return call

    async def _pump(self, call, ids: list[str], outputs: asyncio.Queue, arrival: float, last_token: dict) -> None:
        unfinished = set(ids)
        try:
            async for batch in call:
                if isinstance(batch, Refused):
                    raise batch.error()
                now = time.monotonic()
                for out in batch:
                    self._observe(out, now, arrival, last_token)
                    outputs.put_nowait(out)
                    if out.finished:
                        unfinished.discard(out.request_id)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:  # the replica died mid-request, or shut down: these requests end in an error
            log.warning("a replica failed %d running request(s): %s", len(unfinished), exc)
            for rid in unfinished:
                outputs.put_nowait(RequestOutput(rid, "", "", [], True, "error", 0, 0,
                                                 error=f"the replica running it failed ({type(exc).__name__})"))
                self.metrics.requests_finished.labels("error").inc()
        finally:
            for rid in ids:
                self._calls.pop(rid, None)

    def _observe(self, out: RequestOutput, now: float, arrival: float, last_token: dict) -> None:
        """Latency and token metrics; last_token: request id -> when its latest token came."""
        if out.finish_reason != "error" and out.token_ids:
            last = last_token.get(out.request_id)
            if last is None:
                self.metrics.time_to_first_token.observe(now - arrival)
            else:
                self.metrics.inter_token_latency.observe(now - last)
            last_token[out.request_id] = now
        if out.finished:
            self.metrics.requests_finished.labels(out.finish_reason).inc()
            self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
            self.metrics.generation_tokens.inc(len(out.token_ids))
            self.metrics.spec_proposed.inc(out.num_proposed_tokens)
            self.metrics.spec_accepted.inc(out.num_accepted_tokens)

    def abort(self, request_ids: list[str]) -> None:
        for task in {self._calls[rid] for rid in request_ids if rid in self._calls}:
            task.cancel()

    def abort_all(self) -> None:
        self.abort(list(self._calls))


class KilnIngress:
    """The HTTP front (Serve's ingress deployment): create_app over a ReplicaPool per model, with the fleet's
    tiers, API keys and limits. reload_keys() reads the key file again (the driver calls it on SIGHUP)."""

    async def __init__(self, deployments: dict[str, dict], tiers: tuple = (), max_waiting: int = 64,
                       max_request_bytes: int = 1 << 20, keys: ApiKeys | None = None, metrics_open: bool = False):
        self.pools = {}
        for name, d in deployments.items():
            described = await d["replicas"].describe.remote()
            if d.get("prefill") is not None:
                await d["prefill"].describe.remote()  # both routers know their replicas from here on
            frontend = ModelFrontend(d["engine"], d["options"], described)
            self.pools[name] = ReplicaPool(d["replicas"], frontend, max_waiting, ReplicaMetrics(name),
                                           d.get("prefill"), d["expected_replicas"])
        self.keys = keys  # auth.ApiKeys (pickled here whole, its key file path absolute), or None
        self.tiers, self.max_request_bytes, self.metrics_open = tiers, max_request_bytes, metrics_open

    def reload_keys(self) -> int:
        """Read the key file again; the number of keys now accepted."""
        if self.keys is None:
            return 0
        self.keys.reload()
        return len(self.keys.keys)

    def __serve_build_asgi_app__(self):
        from runtime.serving.app import create_app

        return create_app(self.pools, self.tiers, self.max_request_bytes, self.keys, self.metrics_open)


class ReplicaMetrics(ServerMetrics):
    """The server's metrics for replicas: latencies and token counts as the ingress sees them; queue, KV and
    prefix-cache gauges summed over the replicas' last reports (about a second old) at each scrape, and
    per replica (kiln_replica_*). kiln_num_preemptions stays 0 here: see kiln_replica_preemptions."""

    GAUGES = {
        "running": "Sequences holding KV blocks on the replica.",
        "waiting": "Sequences queued for admission on the replica.",
        "kv_usage": "Fraction of the replica's KV blocks held by sequences.",
        "prefix_hit_rate": "Prompt tokens served from the replica's prefix cache / tokens looked up, since start.",
        "predicted_hit_rate": "Prompt blocks the router expected the replica to hold / blocks routed there.",
        "routed": "Requests the router sent to the replica.",
        "preemptions": "Sequences the replica preempted for lack of KV blocks, since it started.",
        "pid": "Process id of the replica (its engine's rank 0).",
        "rss_bytes": "Resident memory of the replica's process.",
        "cpu_utilisation": "CPU seconds per second of the replica's process (and its finished children).",
    }

    def __init__(self, model: str):
        super().__init__()
        from prometheus_client import Gauge

        self.model = model  # whose replicas' routers to read
        self.replica_gauges = {key: Gauge(f"kiln_replica_{key}", text, ["replica"], registry=self.registry)
                               for key, text in self.GAUGES.items()}
        self.replicas = Gauge("kiln_replicas", "Replicas the router can send requests to.", registry=self.registry)
        self.gpu_memory = Gauge("kiln_replica_gpu_memory_used_bytes", "GPU memory in use (NVML).",
                                ["replica", "gpu"], registry=self.registry)
        self.gpu_utilisation = Gauge("kiln_replica_gpu_utilisation", "GPU busy fraction (NVML).",
                                     ["replica", "gpu"], registry=self.registry)

    def refresh(self) -> None:
        for gauge in (*self.replica_gauges.values(), self.gpu_memory, self.gpu_utilisation):
            gauge.clear()  # replicas that are gone leave no series behind
        from runtime.serving.ray_router import replica_figures

        replicas = replica_figures(self.model)
        total = {key: sum(f.get(key, 0) for f in replicas.values())
                 for key in ("running", "waiting", "prefix_hits", "prefix_queries")}
        self.requests_running.set(total["running"])
        self.requests_waiting.set(total["waiting"])
        self.kv_cache_usage.set(sum(f.get("kv_usage", 0.0) for f in replicas.values()) / max(1, len(replicas)))
        self.prefix_cache_hit_rate.set(total["prefix_hits"] / total["prefix_queries"] if total["prefix_queries"]
                                       else 0.0)
        self.replicas.set(len(replicas))
        for rid, figures in replicas.items():
            queries = figures.get("prefix_queries", 0)
            figures["prefix_hit_rate"] = figures.get("prefix_hits", 0) / queries if queries else 0.0
            for key, gauge in self.replica_gauges.items():
                if key in figures:
                    gauge.labels(rid).set(figures[key])
            for key, value in figures.items():
                if key.startswith("gpu") and key.endswith("_memory_used_bytes"):
                    self.gpu_memory.labels(rid, key[3:].split("_")[0]).set(value)
                elif key.startswith("gpu") and key.endswith("_utilisation"):
                    self.gpu_utilisation.labels(rid, key[3:].split("_")[0]).set(value)


# ------------------------------------------------------------------------------------------ the app

def build_app(fleet: Fleet, options: dict[str, EngineOptions], pools: dict[str, dict], *, max_waiting: int = 64,
              max_request_bytes: int = 1 << 20, drain_timeout: float = 30.0, keys: ApiKeys | None = None,
              metrics_open: bool = False):
    """The Serve application: KilnIngress in front of each model's KilnReplicas (disaggregated: its KilnPrefill
    and KilnDecode workers). pools: per model, its KV block_size, blocks_per_replica and max_batch_size."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    def engines(model: ModelSpec, role: str, count: int, max_count: int | None = None):
        pool = pools[model.name]
        scaling: dict[str, Any] = {"num_replicas": count}
        if max_count is not None and max_count > count:
            scaling = {"autoscaling_config": {
                "min_replicas": count, "max_replicas": max_count,
                "target_ongoing_requests": max(1, pool["max_batch_size"] // 2), "look_back_period_s": 10,
                "upscale_delay_s": 5, "downscale_delay_s": 60}}
        name = role if len(fleet.models) == 1 else f"{role}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model.name)}"
        deployment = serve.deployment(
            KilnReplica, name=name, ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=pool["max_batch_size"] + max_waiting,
            health_check_period_s=model.plan.health_check_period_s, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=drain_timeout,
            request_router_config=RequestRouterConfig(
                request_router_class="runtime.serving.ray_router:KilnRouter",
                request_router_kwargs={"policy": model.plan.routing, "block_size": pool["block_size"],
                                       "blocks_per_replica": pool["blocks_per_replica"], "model": model.name},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
            **scaling)
        return deployment.bind(str(model.engine), options[model.name], max_waiting)

    deployments = {}
    for model in fleet.models:
        plan = model.plan
        if plan.prefill_replicas:
            deployments[model.name] = {"replicas": engines(model, "KilnDecode", plan.replicas),
                                       "prefill": engines(model, "KilnPrefill", plan.prefill_replicas)}
        else:
            deployments[model.name] = {"replicas": engines(model, "KilnReplica", plan.replicas, plan.max_replicas)}
        deployments[model.name].update(engine=str(model.engine), options=options[model.name],
                                       expected_replicas=plan.num_engines)
    ingress = serve.deployment(serve.ingress()(KilnIngress), name="KilnIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(deployments, fleet.tiers, max_waiting, max_request_bytes, keys, metrics_open)


def application(fleet: Fleet, options: EngineOptions, **server):
    """The Serve application for a fleet, each engine checked first; every model gets `options` with its own
    threads, KV size and backend where the fleet gives them, and the host's cores shared between all ranks
    where neither says. server: build_app's keywords."""
    from runtime.backend import kv_groups
    from runtime.cpus import usable_cpus
    from runtime.engine import _lowered
    from runtime.engine_format import EngineError, check_target

    manifests = {m.name: open_engine(m.engine, check_hashes=False, backend=m.backend or options.backend).manifest
                 for m in fleet.models}
    all_ranks = sum(m.plan.num_engines * manifests[m.name].world_size for m in fleet.models)
    per_model, pools = {}, {}
    for model in fleet.models:
        manifest = manifests[model.name]
        chosen = model_options(model, options)
        if model.plan.prefill_replicas and manifest.world_size != 1:
            raise EngineError(f"--disaggregate hands K/V between one-rank engines; {model.engine} has "
                              f"{manifest.world_size} ranks")
        if chosen.num_threads is None:  # the host's cores shared between every replica's ranks
            chosen = dataclasses.replace(chosen, num_threads=max(1, usable_cpus() // all_ranks))
        backend = check_target(Path(model.engine), manifest, chosen.backend)
        per_model[model.name] = chosen
        pools[model.name] = {"block_size": manifest.block_size,
                             "blocks_per_replica": kv_groups(manifest, backend, chosen.kv_cache_gib).num_blocks[0],
                             "max_batch_size": _lowered(manifest.limits, chosen).max_batch_size}
    return build_app(fleet, per_model, pools, **server)


def app_builder(args: dict[str, str]):
    """For Ray Serve's own tools on an existing cluster: `serve run runtime.serving.replicas:app_builder
    engine=DIR [replicas=2] [max_replicas=M] [routing=prefix] [disaggregate=P:D] [threads=N]
    [kv_cache_gib=G]` or `fleet=FILE [threads=N] [kv_cache_gib=G]`, or a Serve config file whose application
    has this import_path and these args. Engine directories must be at their paths on every node."""
    known = {"engine", "fleet", "replicas", "max_replicas", "routing", "disaggregate", "threads", "kv_cache_gib"}
    if ("engine" in args) == ("fleet" in args) or set(args) - known:
        raise ValueError(f"app_builder args: engine=DIR or fleet=FILE is required; known: {', '.join(sorted(known))}; "
                         f"got {', '.join(sorted(args)) or 'none'}")
    options = EngineOptions(num_threads=int(args["threads"]) if "threads" in args else None,
                            kv_cache_gib=float(args["kv_cache_gib"]) if "kv_cache_gib" in args else None,
                            check_hashes=False)
    if "fleet" in args:
        from runtime.serving.fleet import load_fleet

        return application(load_fleet(Path(args["fleet"])), options)
    fields = {"max_replicas": int(args["max_replicas"]) if "max_replicas" in args else None,
              "routing": args.get("routing", "prefix")}
    plan = (ReplicaPlan.disaggregated(args["disaggregate"], **fields) if "disaggregate" in args
            else ReplicaPlan(replicas=int(args.get("replicas", 2)), **fields))
    from runtime.serving.fleet import from_arguments

    return application(from_arguments([args["engine"]], None, plan), options)


def serve_replicas(fleet: Fleet, options: EngineOptions, *, host: str = "127.0.0.1", port: int = 8000,
                   drain_timeout: float = 30.0, ray_address: str | None = None, **server) -> int:
    """Run the fleet's engines as Serve deployments until SIGTERM/SIGINT, on a local Ray instance started here,
    or on the Ray cluster at ray_address; SIGHUP has the ingress read the API key file again. Returns the exit
    code. server: build_app's keywords."""
    import signal
    import threading

    import ray
    from ray import serve

    from runtime.cpus import usable_cpus
    from runtime.engine_format import EngineError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    app = application(fleet, options, drain_timeout=drain_timeout, **server)
    local = ray_address is None
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING,
             **({"num_cpus": usable_cpus(), "object_store_memory": 256 << 20} if local else {}))
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # in place of Ray's (which exits at once), before Serve starts
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: (reload.set(), stop.set()))
    try:
        serve.start(http_options={"host": host, "port": port})
        engines = sum(m.plan.num_engines for m in fleet.models)
        print(f"Starting {engines} engine replica(s) on Ray {'(local)' if local else ray_address} ...", flush=True)
        try:
            ingress = serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as exc:  # a replica's constructor failed: its first line says why
            raise EngineError(f"the replicas did not start: {str(exc).strip().splitlines()[-1]}") from None
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        for model in fleet.models:
            plan = model.plan
            scaling = (f"{plan.prefill_replicas} prefill and {plan.replicas} decode" if plan.prefill_replicas
                       else f"{plan.replicas}-{plan.max_replicas} (autoscaled)" if plan.max_replicas
                       else str(plan.replicas))
            print(f"Kiln is serving {model.name} at http://{shown}:{port}/v1 from {scaling} replica(s), "
                  f"{plan.routing} routing", flush=True)
        for tier in fleet.tiers:
            print(f"  tier {tier.name}: {' -> '.join(tier.models)}", flush=True)
        print("(metrics: /metrics, health: /health)", flush=True)
        while True:
            stop.wait()
            if not reload.is_set():
                break
            stop.clear()
            reload.clear()
            log.info("API keys: %d accepted", ingress.reload_keys.remote().result())
        log.info("shutting down: running requests get up to %gs", drain_timeout)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
