"""BlockManager: the paged KV cache's blocks, reference counts, free queue and prefix cache.

Blocks hold block_size tokens; slot s of the cache is block s // block_size, offset s % block_size.

Prefix cache. A full block whose K/V has been computed is registered under a chained hash,
blake2b(parent block's hash + the block's token ids as little-endian int64), so equal hashes mean
equal whole prefixes. Blocks are registered as soon as they become full and computed, during
prefill and decode alike, so a later request can reuse generated text as well as prompts. Only
computed blocks are registered, so a request never reuses K/V that a pending chunk has yet to write.
When a hash is already registered to another block (two requests computed the same block at the
same time), the newer block stays unregistered and is simply freed later.

A new sequence looks its full blocks up in order and stops at the first miss. The last token must
always be computed (its logits give the first output token), so lookups consider only the full
blocks within the first num_tokens - 1 tokens: when a block-aligned prompt is cached entirely,
its last block is not counted as a hit and is recomputed into a fresh block (no copy-on-write).

Free queue (ordered, O(1) removal because a hit revives a cached block from the middle): a fresh
pool hands out blocks 0, 1, 2, ... A freed block that holds a registered hash keeps it and goes to
the back, so cached blocks are evicted least recently freed first; a sequence's blocks are freed
last block first, so its tail is evicted before its prefix. A freed block with no hash holds
nothing reusable and goes to the front, to be reused before any cached block is evicted.
Allocation takes blocks from the front, dropping the hash of a cached block it evicts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtime.sequence import Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: identifies the block's tokens and every token before them."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # registered in the prefix cache while set


class BlockManager:
    """Hands out KV blocks to sequences, shares full blocks between equal prefixes, counts hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0     # of those, tokens whose K/V was reused

    # ------------------------------------------------------------------------------ queries

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evictable)."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether allocate(seq) would succeed now."""
        hits = self._cached_prefix(seq)
        num_revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        num_new = self.blocks_needed(seq.num_tokens) - len(hits)
        return num_new <= self.num_free_blocks - num_revived

    def can_append(self, seq: Sequence) -> bool:
        """Whether append_slot(seq) would succeed now."""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens) or self.num_free_blocks >= 1

    # ------------------------------------------------------------------------------ changes

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the blocks for all its tokens, reusing its cached prefix.

        Sets block_table, block_hashes, and num_cached_tokens = num_computed_tokens = the reused tokens.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id!r} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq):
            raise RuntimeError(f"{seq.request_id!r} needs {self.blocks_needed(seq.num_tokens)} blocks, "
                               f"{self.num_free_blocks} free")
        hits = self._cached_prefix(seq)
        for block_id in hits:  # revive before taking new blocks, so none of these is evicted
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_hashes.append(block.block_hash)
        new = [self._take_free_block() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        seq.block_table = hits + new
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    def append_slot(self, seq: Sequence) -> None:
        """Make the block table cover every token of seq (a new block when the last one is full)."""
        if len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free_block())

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover num_tokens positions (speculative guesses beyond seq's tokens)."""
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's tokens (they held only rejected guesses: never hashed)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the full blocks that became computed since the last call (after each step)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(block_hash)
            if block_hash not in self.hash_to_block_id:
                self.hash_to_block_id[block_hash] = seq.block_table[i]
                self.blocks[seq.block_table[i]].block_hash = block_hash

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, last block first; blocks nobody else holds become free."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    # ------------------------------------------------------------------------------ internals

    def _release(self, block_id: int) -> None:
        """Drop one holder of a block; unheld, it is free, and reused first unless it holds cached K/V."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.block_hash is None:
                self.free_block_ids.move_to_end(block_id, last=False)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of seq's longest cached prefix of full blocks, within its first num_tokens - 1 tokens."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((seq.num_tokens - 1) // bs):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            del self.hash_to_block_id[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id
