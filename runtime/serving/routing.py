"""Cache-aware routing across engine replicas: send a request where its prompt prefix is likely cached.

Each replica's BlockManager keeps the K/V of full prompt blocks under chained hashes
(runtime/core/kv_cache.py hash_block_tokens: a block's hash covers every token before it), so a block
hash names a whole prefix. The router cannot see the replicas' caches; it remembers instead which
block hashes it sent to each replica, in a least-recently-used record as large as the replica's KV
pool, and that is what a replica's cache holds unless other traffic evicted it sooner.

A request's score on a replica is the number of its leading blocks in that record (a chain breaks
at the first block missing, as BlockManager's own lookup does). The request goes to the replica
with the longest match, lower load breaking ties, unless that replica's load exceeds the least
loaded one's by more than `max_imbalance` requests: then load wins and it goes to the least loaded,
so one popular system prompt cannot pile every request onto one replica.

This module is the policy alone: it takes replica loads as numbers and returns replica ids, so the
replicas' transport supplies both (ray_router.py: Ray Serve's router for `engine-run serve --replicas`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from runtime.core.kv_cache import hash_block_tokens


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of a prompt's full blocks, the same a replica's BlockManager gives them."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


@dataclass
class ReplicaRecord:
    """What the router sent to one replica: block hashes, least recently used first, at most `capacity`."""

    capacity: int
    hashes: OrderedDict = field(default_factory=OrderedDict)
    routed: int = 0         # requests sent here
    matched_blocks: int = 0  # of their prompt blocks, the ones the record predicted cached
    prompt_blocks: int = 0

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt the record holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)

    @property
    def predicted_hit_rate(self) -> float:
        return self.matched_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class PrefixAwareRouter:
    """Chooses a replica for each request from its prompt's block hashes and the replicas' loads."""

    def __init__(self, replica_ids: list[str], block_size: int, blocks_per_replica: int, max_imbalance: int = 4):
        if block_size < 1 or blocks_per_replica < 1 or max_imbalance < 0:
            raise ValueError(f"router: block_size and blocks_per_replica must be >= 1 and max_imbalance >= 0, "
                             f"got {block_size}, {blocks_per_replica}, {max_imbalance}")
        self.block_size, self.max_imbalance = block_size, max_imbalance
        self.blocks_per_replica = blocks_per_replica
        self.records = {r: ReplicaRecord(blocks_per_replica) for r in replica_ids}

    def add_replica(self, replica_id: str) -> None:
        """A new replica (or one replaced after dying) starts with nothing cached."""
        self.records[replica_id] = ReplicaRecord(self.blocks_per_replica)

    def remove_replica(self, replica_id: str) -> None:
        self.records.pop(replica_id, None)

    def rank(self, token_ids: list[int], loads: dict[str, int]) -> list[str]:
        """The replicas in `loads` best first for a prompt, given each one's load (requests running and
        waiting): the longest match among replicas within max_imbalance of the least loaded, lower load
        breaking ties, then the rest by load. Replicas missing from `loads` are not ranked."""
        candidates = [r for r in self.records if r in loads]
        if not candidates:
            raise ValueError("no replica to route to: none of the known replicas reported a load")
        hashes = prompt_block_hashes(token_ids, self.block_size)
        least = min(loads[r] for r in candidates)
        matches = {r: self.records[r].match(hashes) for r in candidates}
        balanced = [r for r in candidates if loads[r] - least <= self.max_imbalance]
        # Ties go to the less loaded, then to the replica holding fewer blocks, so fresh prefixes spread out.
        chosen = max(balanced, key=lambda r: (matches[r], -loads[r], -len(self.records[r].hashes)))
        return [chosen] + sorted((r for r in candidates if r != chosen), key=lambda r: loads[r])

    def record(self, replica_id: str, token_ids: list[int]) -> None:
        """The prompt went to the replica: its blocks are now (likely) cached there."""
        hashes = prompt_block_hashes(token_ids, self.block_size)
        record = self.records[replica_id]
        record.routed += 1
        record.matched_blocks += record.match(hashes)
        record.prompt_blocks += len(hashes)
        record.add(hashes)

    def route(self, token_ids: list[int], loads: dict[str, int]) -> str:
        """rank()'s first choice, recorded."""
        chosen = self.rank(token_ids, loads)[0]
        self.record(chosen, token_ids)
        return chosen
