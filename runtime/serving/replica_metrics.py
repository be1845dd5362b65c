"""Per-replica figures for `engine-run serve --replicas N`: the process's CPU time, memory and GPU figures a
replica reports with its routing stats, and the ingress's /metrics series of them."""


from __future__ import annotations

import logging
import os
import resource
from typing import TYPE_CHECKING

from runtime.serving.metrics import ServerMetrics

if TYPE_CHECKING:
    pass

log = logging.getLogger("kiln.replicas")



def cpu_seconds() -> float:
    """CPU time of this process and its finished children (rank processes included once they end)."""
    usage = os.times()
    return usage.user + usage.system + usage.children_user + usage.children_system


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_figures() -> dict:
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
        "kv_handoffs": "Prefilled requests a decode replica took from a prefill replica, since it started.",
        "kv_handoff_bytes": "Their K/V bytes, since it started.",
        "kv_handoff_seconds": "Their summed time from the prefill replica reading the K/V out to this one taking it.",
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


