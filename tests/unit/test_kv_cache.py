"""BlockManager: exact block ids, reference counts, prefix hits and eviction order."""

import hashlib
import struct

from runtime.core.kv_cache import BlockManager, hash_block_tokens
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, list(token_ids))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What a step followed by postprocess does: every token's K/V is now in the cache."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free_block_ids)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_fresh_pool_hands_out_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(10))
    assert bm.blocks_needed(10) == 3 and bm.blocks_needed(8) == 2 and bm.blocks_needed(0) == 0
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert a.num_cached_tokens == a.num_computed_tokens == 0
    assert bm.num_free_blocks == 5 and bm.usage == 3 / 8
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    b = make_seq(range(100, 105), "b")
    bm.allocate(b)
    assert b.block_table == [3, 4]
    bm.free(a)  # nothing computed, nothing hashed: all three go to the front, to be reused first
    assert a.block_table == [] and ref_counts(bm)[:3] == [0, 0, 0]
    assert free_order(bm) == [0, 1, 2, 5, 6, 7]
    assert bm.usage == 2 / 8


def test_hash_is_blake2b_of_parent_and_little_endian_tokens():
    root = hashlib.blake2b(struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    child = hashlib.blake2b(root + struct.pack("<4q", 5, 6, 7, 8), digest_size=16).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]) == root
    assert hash_block_tokens(root, [5, 6, 7, 8]) == child


def test_shared_prefix_reuses_blocks_and_skips_their_prefill():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10), "a")  # blocks: [0..3] [4..7] [8, 9]
    bm.allocate(a)
    compute_all(bm, a)
    assert [bm.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    assert bm.hash_to_block_id == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}

    b = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 99], "b")
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == b.num_computed_tokens == 8 and b.num_pending_tokens == 1
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (19, 8)

    c = make_seq([0, 1, 2, 3, 40, 5, 6, 7, 8], "c")  # first block matches, second differs
    bm.allocate(c)
    assert c.block_table == [0, 4, 5] and c.num_cached_tokens == 4
    d = make_seq([9, 1, 2, 3, 4, 5, 6, 7, 8], "d")  # same second block, other parent: the chain misses
    bm.allocate(d)
    assert d.block_table == [6, 7, 8] and d.num_cached_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (37, 12)

    bm.free(a)  # block 0 and 1 are still held by b and c
    assert ref_counts(bm)[:3] == [2, 1, 0]
    assert 0 not in bm.free_block_ids and 1 not in bm.free_block_ids


def test_eviction_is_least_recently_freed_first_and_tail_before_prefix():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    compute_all(bm, a)
    bm.free(a)  # 2 holds no hash -> front; then 1, 0 (cached) -> back, tail first
    assert free_order(bm) == [2, 3, 4, 5, 1, 0]

    b = make_seq([11, 12, 13, 14, 15], "b")
    bm.allocate(b)
    assert b.block_table == [2, 3, 4]
    compute_all(bm, b)
    bm.free(b)
    assert free_order(bm) == [4, 5, 1, 0, 3, 2]
    assert len(bm.hash_to_block_id) == 4

    c = make_seq(range(100, 109), "c")  # 5 blocks: evicts a's tail, a's head, then b's tail
    bm.allocate(c)
    assert c.block_table == [4, 5, 1, 0, 3]
    assert free_order(bm) == [2]
    assert bm.hash_to_block_id == {hash_block_tokens(None, [11, 12]): 2}
    assert [bm.blocks[i].block_hash for i in (0, 1, 3)] == [None, None, None]

    bm.free(c)
    again_b = make_seq([11, 12, 13, 14, 15], "b2")
    bm.allocate(again_b)  # b's first block survived
    assert again_b.block_table[0] == 2 and again_b.num_cached_tokens == 2
    again_a = make_seq([1, 2, 3, 4, 5], "a2")
    assert bm.allocate(again_a) is None and again_a.num_cached_tokens == 0


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(8), "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert a.block_table == [0, 1] and len(bm.hash_to_block_id) == 2

    # The whole prompt is cached, but its last token must be computed for logits: the block
    # holding it is not counted as a hit, and all its tokens are recomputed into a fresh block.
    b = make_seq(range(8), "b")
    bm.allocate(b)
    assert b.block_table == [0, 2]
    assert b.num_cached_tokens == b.num_computed_tokens == 4 and b.num_pending_tokens == 4
    assert ref_counts(bm)[:3] == [2, 1, 1]
    compute_all(bm, b)  # block 2 duplicates block 1's hash: it stays unregistered
    assert bm.blocks[2].block_hash is None and bm.hash_to_block_id[b.block_hashes[1]] == 1
    bm.free(b)
    assert free_order(bm)[0] == 2 and ref_counts(bm)[:3] == [1, 1, 0]

    # One token past the cached blocks: both are hits and only the last token is computed.
    c = make_seq(list(range(8)) + [50], "c")
    bm.allocate(c)
    assert c.block_table == [0, 1, 2] and c.num_cached_tokens == 8 and c.num_pending_tokens == 1

    # A one-block prompt that is cached entirely has no hit at all.
    bm2 = BlockManager(num_blocks=4, block_size=4)
    x = make_seq(range(4), "x")
    bm2.allocate(x)
    compute_all(bm2, x)
    y = make_seq(range(4), "y")
    bm2.allocate(y)
    assert y.block_table == [1] and y.num_cached_tokens == 0


def test_can_allocate_counts_revived_cached_blocks_and_allocation_never_evicts_a_hit():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([0, 1, 2, 3, 4], "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert free_order(bm) == [2, 3, 1, 0] and bm.num_free_blocks == 4

    too_long = make_seq([0, 1, 2, 3, 7, 8, 9, 10, 11], "long")  # 5 blocks
    assert not bm.can_allocate(too_long)
    b = make_seq([0, 1, 2, 3, 7, 8, 9, 10], "b")  # 2 hits (both free) + 2 new = all 4 blocks
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 2, 3] and b.num_cached_tokens == 4
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert not bm.can_allocate(make_seq([5], "c"))


def test_append_slot_adds_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq(range(4), "a")
    bm.allocate(a)
    a.append_token(9)  # 5 tokens: the 5th needs block 1
    assert bm.can_append(a)
    bm.append_slot(a)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 0
    a.append_token(10)  # fits in block 1: no new block, even with none free
    assert bm.can_append(a)
    bm.append_slot(a)
    assert a.block_table == [0, 1]
    for t in (11, 12, 13):
        a.append_token(t)
    assert not bm.can_append(a)


def test_blocks_filled_by_decode_are_registered_for_reuse():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq([5, 6, 7], "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block_id == {}
    a.append_token(8)  # sampled; its K/V is written by the next decode step
    bm.append_slot(a)
    compute_all(bm, a)
    assert bm.hash_to_block_id == {hash_block_tokens(None, [5, 6, 7, 8]): 0}
    b = make_seq([5, 6, 7, 8, 1], "b")
    bm.allocate(b)
    assert b.block_table == [0, 1] and b.num_cached_tokens == 4


def test_only_computed_blocks_are_registered():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(10), "a")
    bm.allocate(a)
    a.num_computed_tokens = 7  # a first chunk of 7 tokens: block 0 full, block 1 still being written
    bm.cache_blocks(a)
    assert bm.hash_to_block_id == {hash_block_tokens(None, [0, 1, 2, 3]): 0} and len(a.block_hashes) == 1
    b = make_seq(range(10), "b")
    bm.allocate(b)
    assert b.block_table == [0, 3, 4] and b.num_cached_tokens == 4
    a.num_computed_tokens = 10
    bm.cache_blocks(a)
    assert len(bm.hash_to_block_id) == 2 and bm.blocks[1].block_hash == a.block_hashes[1]


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3], "b")
    bm.allocate(b)
    assert b.block_table == [2, 3] and b.num_cached_tokens == 0
    assert bm.hash_to_block_id == {} and bm.prefix_cache_queries == 0


# ---------------------------------------------------------------------------- sliding-window layers

def run_step(bm: BlockManager, seq: Sequence, n: int) -> None:
    """A step computing seq's next n tokens, as the scheduler, the executor and postprocess do it."""
    bm.append_slots(seq, seq.num_computed_tokens + n)
    seq.num_computed_tokens += n
    bm.cache_blocks(seq)


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    seq.append_token(token)
    assert bm.can_append(seq)
    bm.append_slot(seq)
    run_step(bm, seq, 1)


def held(table: list[int]) -> list[int]:
    return [b for b in table if b >= 0]


def test_windowed_blocks_behind_the_window_go_back_and_the_sequence_runs_in_a_small_pool():
    # window 8, blocks of 4, steps of at most 4 tokens: a sequence holds at most ceil((8 - 1 + 4) / 4) + 1 = 4
    # blocks, so a pool of 4 runs one of 36 tokens (9 blocks' worth); a second cannot be admitted beside it.
    bm = BlockManager(num_blocks=4, block_size=4, windows=(8,), max_step_tokens=4)
    a = Sequence("a", list(range(6)), SamplingParams(max_tokens=30))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [] and bm.reserved[a] == 4
    assert not bm.can_allocate(Sequence("b", [1, 2], SamplingParams(max_tokens=2)))
    run_step(bm, a, 4)
    run_step(bm, a, 2)
    assert a.block_table == [0, 1]
    for token in range(100, 129):
        decode(bm, a, token)
        # a query at the next position sees its last 8 positions: every block before that is given back
        first = max(0, a.num_computed_tokens - 7) // 4
        assert a.block_table[:first] == [-1] * first and -1 not in a.block_table[first:]
        assert len(held(a.block_table)) <= 8 // 4 + 1
    assert a.num_tokens == 35 and len(a.block_table) == 9
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.reserved == {} and bm.usage == 0.0


def test_full_layers_keep_every_block_beside_a_windowed_pool():
    bm = BlockManager(num_blocks=(16, 4), block_size=4, windows=(0, 8), max_step_tokens=4)
    a = Sequence("a", list(range(10)), SamplingParams(max_tokens=20))
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.window_block_table == []  # full: all at once; windowed: per step
    for n in (4, 4, 2):
        run_step(bm, a, n)
    for token in range(19):
        decode(bm, a, token)
    assert a.block_table == list(range(8)) and bm.num_free_blocks == 8
    assert a.window_block_table[:5] == [-1] * 5 and len(held(a.window_block_table)) <= 3
    assert bm.tables(a) == [a.block_table, a.window_block_table]


def test_a_windowed_prefix_hit_needs_only_the_blocks_under_the_window():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(8,), max_step_tokens=16)
    a = make_seq(range(17), "a")
    bm.allocate(a)
    run_step(bm, a, 16)
    assert a.block_table == [-1, -1, 2, 3]  # positions 0-7 lie behind the window of a query at 16
    bm.free(a)
    b = make_seq(list(range(16)) + [99, 98], "b")
    bm.allocate(b)
    # blocks 2 and 3 (positions 8-15) are all a query at 16 sees: a hit of 16 tokens, with -1 before them
    assert b.num_cached_tokens == 16 and b.block_table == [-1, -1, 2, 3]
    c = make_seq(list(range(12)) + [7, 7, 7, 7, 7], "c")
    bm.allocate(c)
    # a query at 12 sees positions 5-11: block 1, given back by a but still cached, and block 2 (b holds it)
    assert c.num_cached_tokens == 12 and c.block_table == [-1, 1, 2]
    assert [bm.blocks[i].ref_count for i in (1, 2, 3)] == [1, 2, 1]


def test_a_hand_off_sequence_keeps_its_windowed_blocks_to_be_read_out():
    bm = BlockManager(num_blocks=8, block_size=4, windows=(8,), max_step_tokens=16)
    a = Sequence("a", list(range(20)), SamplingParams(max_tokens=1))
    a.hand_off = True
    bm.allocate(a)
    assert bm.reserved[a] == 5  # every block of its prompt
    run_step(bm, a, 16)
    run_step(bm, a, 4)
    assert a.block_table == [0, 1, 2, 3, 4]


def test_a_request_longer_than_the_windowed_pool_is_named():
    bm = BlockManager(num_blocks=(32, 2), block_size=4, windows=(0, 8), max_step_tokens=4)
    seq = Sequence("a", list(range(6)), SamplingParams(max_tokens=30))
    assert bm.problem(seq, 36) == "needs 4 KV blocks of the 8-token window layers' pool of 4 tokens, but the cache " \
                                  "has only 2"
    assert BlockManager(num_blocks=4, block_size=4).problem(seq, 36) == \
        "needs 9 KV blocks of 4 tokens, but the cache has only 4"
