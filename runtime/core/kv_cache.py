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

from runtime.format.kv_groups import KVGroups, window_blocks_per_sequence
from runtime.core.sequence import Sequence


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


class BlockPool:
    """One KV group's blocks: reference counts, the free queue and the prefix cache's hash table."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}

    def take(self) -> int:
        """A free block, held once; a cached one it evicts loses its hash."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            del self.hash_to_block_id[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def hold(self, block_id: int) -> None:
        """One more holder of a block (a prefix hit), taking it off the free queue if nobody held it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one holder of a block; unheld, it is free, and reused first unless it holds cached K/V."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.block_hash is None:
                self.free_block_ids.move_to_end(block_id, last=False)

    def register(self, block_hash: bytes, block_id: int) -> None:
        if block_hash not in self.hash_to_block_id:
            self.hash_to_block_id[block_hash] = block_id
            self.blocks[block_id].block_hash = block_hash


class BlockManager:
    """Hands out KV blocks to sequences, shares full blocks between equal prefixes, counts hits.

    With sliding-window layers (runtime/format/kv_groups.py) it runs a pool per KV group: `windows` (0,), (W,)
    or (0, W) with `num_blocks` per group. A windowed group's table (Sequence.block_table when every
    layer is windowed, Sequence.window_block_table beside the full layers' otherwise) gets its blocks as
    the steps need them and gives back, after each step, those wholly before the window of the next
    query (their entries become -1). Admitting a sequence reserves the most blocks it can hold in the
    windowed pool (max_step_tokens bounds a step), so a step never waits for one there.
    """

    def __init__(self, num_blocks: int | tuple[int, ...], block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int, ...] = (0,), max_step_tokens: int = 1):
        counts = (num_blocks,) if isinstance(num_blocks, int) else tuple(num_blocks)
        if min(counts) < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.groups = KVGroups(tuple(windows), counts)  # checks their shape
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_step_tokens = max_step_tokens
        self.pools = [BlockPool(n) for n in counts]
        self.reserved: dict[Sequence, int] = {}  # windowed pool: the blocks each admitted sequence may hold
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0     # of those, tokens whose K/V was reused

    # ------------------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.groups.num_blocks[0]

    @property
    def blocks(self) -> list[Block]:
        return self.pools[0].blocks

    @property
    def free_block_ids(self) -> OrderedDict[int, None]:
        return self.pools[0].free_block_ids

    @property
    def hash_to_block_id(self) -> dict[bytes, int]:
        return self.pools[0].hash_to_block_id

    @property
    def window(self) -> int:
        """The windowed group's window (0: every layer attends fully)."""
        return self.groups.windows[-1]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the first pool no sequence holds, cached ones included (they are evictable)."""
        return len(self.pools[0].free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, over every pool."""
        return 1.0 - sum(len(p.free_block_ids) for p in self.pools) / sum(self.groups.num_blocks)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table of each group."""
        return [seq.block_table, seq.window_block_table][:len(self.pools)]

    def problem(self, seq: Sequence, total_tokens: int) -> str | None:
        """Why a sequence that grows to total_tokens can never run in these pools, or None."""
        for g, (window, count) in enumerate(zip(self.groups.windows, self.groups.num_blocks)):
            need = self._reservation(seq, total_tokens) if window else self.blocks_needed(total_tokens - 1)
            if need > count:
                pool = f" of the {window}-token window layers' pool" if window else ""
                return f"needs {need} KV blocks{pool} of {self.block_size} tokens, but the cache has only {count}"
        return None

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether allocate(seq) would succeed now."""
        _, hits = self._cached_prefix(seq)
        for g, (window, pool) in enumerate(zip(self.groups.windows, self.pools)):
            if window:
                if sum(self.reserved.values()) + self._reservation(seq) > self.groups.num_blocks[g]:
                    return False
                continue
            revived = sum(1 for b in hits[g] if pool.blocks[b].ref_count == 0)
            if self.blocks_needed(seq.num_tokens) - len(hits[g]) > len(pool.free_block_ids) - revived:
                return False
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Whether append_slot(seq) would succeed now (a windowed pool always has the block: it is reserved)."""
        return self.groups.windows[0] > 0 or len(seq.block_table) >= self.blocks_needed(seq.num_tokens) \
            or self.num_free_blocks >= 1

    # ------------------------------------------------------------------------------ changes

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the blocks for all its tokens, reusing its cached prefix (a windowed
        group: the cached blocks its next query sees, the rest as steps need them).

        Sets block_table(s), block_hashes, and num_cached_tokens = num_computed_tokens = the reused tokens.
        """
        if seq.block_table or seq.window_block_table:
            raise RuntimeError(f"{seq.request_id!r} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq):
            raise RuntimeError(f"{seq.request_id!r} needs {self.blocks_needed(seq.num_tokens)} blocks, "
                               f"{self.num_free_blocks} free")
        hashes, hits = self._cached_prefix(seq)
        for pool, ids in zip(self.pools, hits):  # revive before taking new blocks, so none of these is evicted
            for block_id in ids:
                if block_id >= 0:
                    pool.hold(block_id)
        seq.block_hashes = hashes
        for g, (window, table) in enumerate(zip(self.groups.windows, self.tables(seq))):
            table[:] = hits[g]
            if window:
                self.reserved[seq] = self._reservation(seq)
            else:
                table += [self.pools[g].take() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits[g]))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hashes) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    def append_slot(self, seq: Sequence) -> None:
        """Make the block tables cover every token of seq (a new block when the last one is full)."""
        self.append_slots(seq, seq.num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block tables cover num_tokens positions: a step's tokens (a prefill chunk, a decode,
        speculative guesses beyond seq's tokens). A windowed table gets blocks from the first one the
        step's first query sees (earlier entries -1)."""
        needed = self.blocks_needed(num_tokens)
        for g, (window, table) in enumerate(zip(self.groups.windows, self.tables(seq))):
            if window:
                first = self._first_visible_block(seq.num_computed_tokens)
                while len(table) < min(first, needed):
                    table.append(-1)
            while len(table) < needed:
                table.append(self.pools[g].take())

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's tokens (they held only rejected guesses: never hashed)."""
        keep = self.blocks_needed(seq.num_tokens)
        for pool, table in zip(self.pools, self.tables(seq)):
            while len(table) > keep:
                block_id = table.pop()
                if block_id >= 0:
                    pool.release(block_id)

    def cache_blocks(self, seq: Sequence) -> None:
        """After each step: register the full blocks that became computed since the last call, and give back the
        windowed blocks no later query sees (a hand_off sequence keeps them: its K/V is read out at the end)."""
        bs, tables = self.block_size, self.tables(seq)
        if self.enable_prefix_caching:
            for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                block_hash = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs])
                seq.block_hashes.append(block_hash)
                for pool, table in zip(self.pools, tables):
                    if table[i] >= 0:
                        pool.register(block_hash, table[i])
        if self.window and not seq.hand_off:
            pool, table = self.pools[-1], tables[-1]
            i = min(self._first_visible_block(seq.num_computed_tokens), len(table)) - 1
            while i >= 0 and table[i] >= 0:  # those before were given back after earlier steps
                pool.release(table[i])
                table[i] = -1
                i -= 1

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, last block first; blocks nobody else holds become free."""
        for pool, table in zip(self.pools, self.tables(seq)):
            for block_id in reversed(table):
                if block_id >= 0:
                    pool.release(block_id)
            table.clear()
        seq.block_hashes = []
        self.reserved.pop(seq, None)

    # ------------------------------------------------------------------------------ internals

    def _first_visible_block(self, position: int) -> int:
        """The first block a query at `position` (or later) sees through the windowed group's window."""
        return max(0, position - self.window + 1) // self.block_size

    def _reservation(self, seq: Sequence, total_tokens: int | None = None) -> int:
        """The most blocks seq can hold at once in the windowed pool: its window and a step's tokens, or all of
        its tokens when it keeps them for a handoff (the last output token is never written)."""
        total = (seq.num_prompt_tokens + seq.params.max_tokens if total_tokens is None else total_tokens) - 1
        if seq.hand_off:
            return self.blocks_needed(total)
        return window_blocks_per_sequence(self.window, self.block_size, self.max_step_tokens, total)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list[list[int]]]:
        """(hashes of seq's longest cached prefix of full blocks within its first num_tokens - 1 tokens, each
        group's block ids of it). A full group needs every block of the prefix; a windowed one only those its
        next query sees (-1 before them), so the longest prefix both groups hold is taken."""
        empty = [[] for _ in self.pools]
        if not self.enable_prefix_caching or seq.pending_prompt_logprobs:  # those need every position's logits
            return [], empty
        bs, hashes, parent = self.block_size, [], None
        full = self.pools[0] if not self.groups.windows[0] else None
        for i in range((seq.num_tokens - 1) // bs):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs])
            if full is not None and parent not in full.hash_to_block_id:
                break
            hashes.append(parent)
        if not self.window:
            return hashes, [[full.hash_to_block_id[h] for h in hashes]]
        windowed = self.pools[-1].hash_to_block_id
        for n in range(len(hashes), 0, -1):
            first = 0 if seq.hand_off else self._first_visible_block(n * bs)  # a handoff reads every block
            if all(h in windowed for h in hashes[first:n]):
                ids = [-1] * first + [windowed[h] for h in hashes[first:n]]
                return hashes[:n], ([[full.hash_to_block_id[h] for h in hashes[:n]]] if full else []) + [ids]
        return [], empty
