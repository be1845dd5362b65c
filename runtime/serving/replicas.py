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
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.backends import open_engine
from runtime.backends.base import kv_groups
from runtime.backends.cpu.cpus import usable_cpus
from runtime.backends.fetch import local_engine
from runtime.core.engine import EngineOptions, _lowered
from runtime.core.sampling import SamplingParams
from runtime.format.engine_format import EngineError
from runtime.launcher import open_llm_engine
from runtime.serving.engine_loop import ABORTED, EngineLoop, Overloaded
from runtime.serving.fleet import (
    Fleet,
    ModelSpec,
    ReplicaPlan,  # noqa: F401 (where it was)
    from_arguments,
    load_fleet,
    model_options,
)
from runtime.serving.prompts import context_len
from runtime.serving.protocol import APIError
from runtime.serving.ray_rank_group import bundles, failures, start_group

if TYPE_CHECKING:
    from runtime.serving.auth import ApiKeys

log = logging.getLogger("kiln.replicas")

from runtime.serving.replica_metrics import cpu_seconds, gpu_figures, rss_bytes
from runtime.serving.replica_pool import KilnIngress, Refused

APP_NAME = "kiln"
# Disaggregated workers go to the nodes started with their role's Ray resource (`ray start --resources
# '{"kiln_prefill": 1}'`), where any node of the cluster has it; anywhere otherwise.
ROLE_RESOURCES = {"KilnPrefill": "kiln_prefill", "KilnDecode": "kiln_decode"}
ROUTING_STATS_PERIOD_S = 1.0


# ------------------------------------------------------------------------------------------ replica

class KilnReplica:
    """One engine (its EngineLoop, LLMEngine and rank processes) as a Ray Serve replica."""

    async def __init__(self, engine: str, options: EngineOptions, max_waiting: int, nnodes: int = 1):
        source, engine = engine, local_engine(engine)  # a URL: this node's checked copy (runtime/backends/fetch.py)
        nodes, self.rank_hosts = None, []
        if nnodes > 1:  # this node is host 0 of the replica's rank group; the others start their ranks now
            nodes, self.rank_hosts = start_group(source, options, nnodes)
        self.engine_loop = EngineLoop(lambda: open_llm_engine(engine, options, nodes), max_waiting)
        loop = asyncio.get_running_loop()
        settled = loop.create_future()

        def settle() -> None:
            if not settled.done():
                settled.set_result(None)

        self.engine_loop.start(loop, on_ready=lambda: loop.call_soon_threadsafe(settle),
                               on_exit=lambda: loop.call_soon_threadsafe(settle))
        await settled
        if not self.engine_loop.ready:  # Serve reports the constructor's error and retries it
            raise RuntimeError(f"the engine did not start: {self.engine_loop.failure}"
                               + "".join(f"; {said}" for said in failures(self.rank_hosts)))
        self._cpu_seconds = (time.monotonic(), cpu_seconds())

    def describe(self) -> dict:
        """What the ingress needs to read prompts for this engine."""
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
        ended = failures(self.rank_hosts)
        if ended:  # a host of its rank group is gone: the engine would fail at its next step
            raise RuntimeError(f"the replica's rank group lost a host: {ended[0]}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Load, cache and process figures; the router and the ingress's /metrics read them."""
        llm = self.engine_loop.llm
        stats = llm.stats() if llm is not None and self.engine_loop.ready else None
        now, cpu = time.monotonic(), cpu_seconds()
        then, cpu_then = self._cpu_seconds
        self._cpu_seconds = (now, cpu)
        figures = {"pid": os.getpid(), "rss_bytes": rss_bytes(), "healthy": self.engine_loop.ready,
                   "cpu_utilisation": (cpu - cpu_then) / (now - then) if now > then else 0.0}
        if stats is not None:
            figures.update(running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_usage,
                           prefix_queries=stats.prefix_queries, prefix_hits=stats.prefix_hits,
                           preemptions=stats.num_preemptions, kv_handoffs=stats.kv_handoffs,
                           kv_handoff_bytes=stats.kv_handoff_bytes, kv_handoff_seconds=stats.kv_handoff_seconds)
        figures.update(gpu_figures())
        return figures

    def __del__(self) -> None:
        self.engine_loop.stop()


# ------------------------------------------------------------------------------------------ the app

def build_app(fleet: Fleet, options: dict[str, EngineOptions], pools: dict[str, dict], *, max_waiting: int = 64,
              max_request_bytes: int = 1 << 20, drain_timeout: float = 30.0, keys: ApiKeys | None = None,
              metrics_open: bool = False, sources: dict[str, str] | None = None, ingress_node: str | None = None):
    """The Serve application: KilnIngress in front of each model's KilnReplicas (disaggregated: its KilnPrefill
    and KilnDecode workers). pools: per model, its KV block_size, blocks_per_replica and max_batch_size. sources:
    the URL an engine directory was fetched from (runtime/backends/fetch.py), which each replica fetches again on
    its own node. ingress_node: the address of the node the ingress must run on (the one `engine-run serve` runs
    on), so that the endpoint outlives any other node. Prefill and decode workers each go to the nodes that have
    their role's resource (ROLE_RESOURCES) where some node has it."""
    sources = sources or {}
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    roles = role_resources() if ray.is_initialized() else set()

    def engines(model: ModelSpec, role: str, count: int, max_count: int | None = None):
        pool = pools[model.name]
        scaling: dict[str, Any] = {"num_replicas": count}
        if max_count is not None and max_count > count:
            scaling = {"autoscaling_config": {
                "min_replicas": count, "max_replicas": max_count,
                "target_ongoing_requests": max(1, pool["max_batch_size"] // 2), "look_back_period_s": 10,
                "upscale_delay_s": 5, "downscale_delay_s": 60}}
        name = role if len(fleet.models) == 1 else f"{role}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model.name)}"
        placement = {"max_replicas_per_node": 1} if model.plan.spread else {}  # Serve places one a node
        if model.plan.nnodes > 1:  # a placement group a replica, a bundle a node (runtime/serving/ray_rank_group.py)
            placement = {"placement_group_bundles": bundles(model.plan.nnodes),
                         "placement_group_strategy": "STRICT_SPREAD"}
        placed = {"resources": {ROLE_RESOURCES[role]: 0.001}} if ROLE_RESOURCES.get(role) in roles else {}
        deployment = serve.deployment(
            KilnReplica, name=name, ray_actor_options={"num_cpus": 0, **placed}, **placement,
            max_ongoing_requests=pool["max_batch_size"] + max_waiting,
            health_check_period_s=model.plan.health_check_period_s, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=drain_timeout,
            request_router_config=RequestRouterConfig(
                request_router_class="runtime.serving.ray_router:KilnRouter",
                request_router_kwargs={"policy": model.plan.routing, "block_size": pool["block_size"],
                                       "blocks_per_replica": pool["blocks_per_replica"], "model": model.name},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
            **scaling)
        return deployment.bind(sources.get(str(model.engine), str(model.engine)), options[model.name], max_waiting,
                               model.plan.nnodes)

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
    pinned = {"resources": {f"node:{ingress_node}": 0.001}} if ingress_node else {}  # Ray's per-node resource
    ingress = serve.deployment(serve.ingress()(KilnIngress), name="KilnIngress",
                               ray_actor_options={"num_cpus": 0, **pinned},
                               max_ongoing_requests=10_000)
    return ingress.bind(deployments, fleet.tiers, max_waiting, max_request_bytes, keys, metrics_open)


def role_resources() -> set[str]:
    """The disaggregation roles' resources (ROLE_RESOURCES) that some node of the connected Ray cluster has."""
    import ray

    return set(ROLE_RESOURCES.values()) & set(ray.cluster_resources())


def application(fleet: Fleet, options: EngineOptions, **server):  # server: build_app's keywords, sources too
    """The Serve application for a fleet, each engine checked first; every model gets `options` with its own
    threads, KV size and backend where the fleet gives them, and the host's cores shared between all ranks
    where neither says. server: build_app's keywords."""
    opened = {m.name: open_engine(m.engine, check_hashes=False, backend=m.backend or options.backend)
              for m in fleet.models}
    manifests = {name: engine.manifest for name, engine in opened.items()}
    all_ranks = sum(m.plan.num_engines * manifests[m.name].world_size for m in fleet.models)
    per_model, pools = {}, {}
    for model in fleet.models:
        manifest = manifests[model.name]
        chosen = model_options(model, options)
        if model.plan.prefill_replicas and manifest.world_size != 1:
            raise EngineError(f"--disaggregate hands K/V between one-rank engines; {model.engine} has "
                              f"{manifest.world_size} ranks")
        if manifest.world_size % model.plan.nnodes:
            raise EngineError(f"--nnodes {model.plan.nnodes}: {model.engine} has {manifest.world_size} rank(s), which "
                              f"{model.plan.nnodes} nodes cannot share evenly")
        if chosen.num_threads is None:  # the host's cores shared between every replica's ranks (spread: one a node)
            ranks = (manifest.world_size // model.plan.nnodes if model.plan.spread or model.plan.nnodes > 1
                     else all_ranks)
            chosen = dataclasses.replace(chosen, num_threads=max(1, usable_cpus() // ranks))
        backend = opened[model.name].backend
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
        return application(load_fleet(Path(args["fleet"])), options)
    fields = {"max_replicas": int(args["max_replicas"]) if "max_replicas" in args else None,
              "routing": args.get("routing", "prefix")}
    plan = (ReplicaPlan.disaggregated(args["disaggregate"], **fields) if "disaggregate" in args
            else ReplicaPlan(replicas=int(args.get("replicas", 2)), **fields))

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

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    local = ray_address is None
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING,
             **({"num_cpus": usable_cpus(), "object_store_memory": 256 << 20} if local else {}))
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # in place of Ray's (which exits at once), before Serve starts
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: (reload.set(), stop.set()))
    try:  # the ingress on this node: the endpoint outlives any other node
        alive, wanted = sum(1 for node in ray.nodes() if node["Alive"]), max(m.plan.nnodes for m in fleet.models)
        if alive < wanted:
            raise EngineError(f"--nnodes {wanted}: each replica needs {wanted} Ray nodes; the cluster has {alive}")
        app = application(fleet, options, drain_timeout=drain_timeout, ingress_node=ray.util.get_node_ip_address(),
                          **server)
        serve.start(http_options={"host": host, "port": port})
        engines = sum(m.plan.num_engines for m in fleet.models)
        print(f"Starting {engines} engine replica(s) on Ray {'(local)' if local else ray_address} ...", flush=True)
        try:
            ingress = serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as exc:  # a replica's constructor failed: its first line says why
            raise EngineError(f"the replicas did not start: {str(exc).strip().splitlines()[-1]}") from None
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        roles = role_resources()
        for model in fleet.models:
            plan = model.plan
            scaling = (f"{plan.prefill_replicas} prefill{' (on kiln_prefill nodes)' * ('kiln_prefill' in roles)} and "
                       f"{plan.replicas} decode{' (on kiln_decode nodes)' * ('kiln_decode' in roles)}"
                       if plan.prefill_replicas
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
