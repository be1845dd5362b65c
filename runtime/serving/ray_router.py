"""KilnRouter: Ray Serve's request router for KilnReplica handles (imported by Serve, by name, where a handle
routes: in the ingress process). It needs Ray; replicas.py names it without importing it."""

from __future__ import annotations

import itertools

from ray.serve.request_router import RequestRouter

from runtime.serving.routing import PrefixAwareRouter

_ROUTERS: list[KilnRouter] = []  # this process's routers, for the ingress's /metrics


class KilnRouter(RequestRouter):
    """Prefix-aware (routing.PrefixAwareRouter over the prompt's token ids in the call's kwargs) or
    round-robin.

    Load is a replica's calls in flight as Serve counts them (its queue-length cache). The first tier
    is the chosen replica and the others follow as a fallback tier, so a full or dying choice never
    stalls a request. What was sent where is recorded once Serve has sent it (on_request_routed), not
    when it was ranked: a replica that refused the request does not get its blocks in the record."""

    def initialize_state(self, policy: str = "prefix", block_size: int = 16, blocks_per_replica: int = 1024,
                         max_imbalance: int = 4, model: str = ""):
        self.policy, self.model = policy, model  # model: whose replicas (a fleet has a router per deployment)
        self.prefix = PrefixAwareRouter([], block_size, blocks_per_replica, max_imbalance)
        self.turn = itertools.count()
        self.sent: dict[str, int] = {}
        # Serve may unpickle this class by value, with a copy of this module's globals: register in the
        # module as imported in this process, where the ingress's /metrics looks.
        from runtime.serving import ray_router

        ray_router._ROUTERS.append(self)

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in live - set(self.prefix.records):
            self.prefix.add_replica(rid)
        for rid in set(self.prefix.records) - live:  # a replaced replica starts with an empty cache
            self.prefix.remove_replica(rid)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.prefix.remove_replica(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid in by_id.keys() - self.prefix.records.keys():
            self.prefix.add_replica(rid)
        token_ids = pending_request.kwargs.get("token_ids") if pending_request is not None else None
        if self.policy == "round-robin" or token_ids is None:
            ids = sorted(by_id)
            first = ids[next(self.turn) % len(ids)]
            order = [first] + [rid for rid in ids if rid != first]
        else:
            loads = {rid: self.replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
            order = self.prefix.rank(token_ids, loads)
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]]

    def on_request_routed(self, pending_request, replica_id, result):
        token_ids = pending_request.kwargs.get("token_ids")
        if token_ids is None:  # not a generate call
            return
        rid = replica_id.unique_id
        self.sent[rid] = self.sent.get(rid, 0) + 1
        if rid in self.prefix.records:
            self.prefix.record(rid, token_ids)

    def replica_figures(self) -> dict[str, dict]:
        """Each live replica's last reported figures, with what this router sent it."""
        figures = {}
        for replica_id, replica in self.curr_replicas.items():
            rid = replica_id.unique_id
            record = self.prefix.records.get(rid)
            figures[rid] = {**(replica.routing_stats or {}), "routed": self.sent.get(rid, 0),
                            "predicted_hit_rate": record.predicted_hit_rate if record else 0.0}
        return figures


def replica_figures(model: str | None = None) -> dict[str, dict]:
    """The replicas' figures (of one model's deployments, or of all), as the routers of this process last heard
    them."""
    figures: dict[str, dict] = {}
    for router in _ROUTERS:
        if model is None or router.model == model:
            figures.update(router.replica_figures())
    return figures
