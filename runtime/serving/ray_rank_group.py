"""A replica whose ranks run on several Ray nodes: `engine-run serve ENGINE --nnodes K --ray-address ADDR`.

Serve places each such replica in a placement group of K bundles with the STRICT_SPREAD strategy (one bundle a
node, the replica itself in the first; `bundles()`). The replica is host 0 of a --nnodes launch
(runtime/ranks/nodes.py): it runs its share of the engine's ranks and serves the rendezvous on its node's address.
In each other bundle a RankHost actor runs host i's share, as `engine-run serve ENGINE --nnodes K --node-rank i`
does when a person starts it on a host, fetching the engine there first when it is given by URL. A host's ranks
end when rank 0's do; a lost host stops the replica's engine within the rank timeout (the watchdog), Serve's
health check then fails, and Serve replaces the replica with a new group.
"""

from __future__ import annotations

import dataclasses
import socket

from runtime.backends.fetch import local_engine
from runtime.core.engine import EngineOptions
from runtime.format.engine_format import EngineError
from runtime.launcher import host_group
from runtime.ranks.nodes import Nodes

BUNDLE = {"CPU": 0.001}  # a bundle must ask for something; the ranks' threads are --threads, not Ray's CPUs


def bundles(nnodes: int) -> list[dict]:
    """Serve's placement_group_bundles for a replica over `nnodes` nodes (strategy STRICT_SPREAD)."""
    return [dict(BUNDLE) for _ in range(nnodes)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankHost:
    """Host i's share of a replica's ranks, in the replica's placement group (a Ray actor: start_group)."""

    def run(self, engine: str, options: EngineOptions, nodes: Nodes) -> str | None:
        """Runs this host's ranks until rank 0 stops; None when they ended cleanly, else why not."""
        try:
            host_group(nodes.count, nodes.rank, nodes.master_addr, nodes.master_port, local_engine(engine), options)
        except SystemExit as exc:  # a worker host's ranks end the process that runs them; this actor returns
            return None if not exc.code else f"host {nodes.rank}'s ranks exited with status {exc.code}"
        except EngineError as exc:
            return f"host {nodes.rank}: {exc}"
        return f"host {nodes.rank}'s ranks returned without serving"


def start_group(engine: str, options: EngineOptions, nnodes: int) -> tuple[Nodes, list]:
    """From inside a replica placed in its group: host 0's Nodes (this node's address, a free port) and, for each
    other bundle, (a RankHost actor, the reference its run() returns)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        raise EngineError(f"--nnodes {nnodes}: this replica was not placed in a placement group")
    nodes = Nodes(nnodes, 0, ray.util.get_node_ip_address(), free_port())
    actor = ray.remote(num_cpus=0)(RankHost)
    hosts = []
    for i in range(1, nnodes):
        host = actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
        hosts.append((host, host.run.remote(engine, options, dataclasses.replace(nodes, rank=i))))
    return nodes, hosts


def failures(hosts: list) -> list[str]:
    """What the group's other hosts said, of those that have ended (their run() returned or their actor died)."""
    import ray

    said = []
    for _, ref in hosts:
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            try:
                reason = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 the actor or its node died: that is the answer
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if reason:
                said.append(reason)
    return said
