"""Cache-aware routing's policy (runtime/serving/routing.py): prefix affinity, balanced against load."""

import pytest

from runtime.core.kv_cache import BlockManager
from runtime.core.sequence import Sequence
from runtime.serving.routing import PrefixAwareRouter, ReplicaRecord, prompt_block_hashes

SYSTEM = list(range(100, 164))  # a 64-token system prompt: four blocks of 16


def test_prompt_hashes_are_the_ones_a_replica_caches_under():
    tokens = SYSTEM + [7, 8, 9, 10, 11]
    bm = BlockManager(16, 16)
    seq = Sequence("r", tokens)
    bm.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    bm.cache_blocks(seq)
    assert prompt_block_hashes(tokens, 16) == seq.block_hashes and len(seq.block_hashes) == 4


def test_a_shared_prefix_follows_its_replica_while_loads_are_close():
    router = PrefixAwareRouter(["a", "b", "c"], block_size=16, blocks_per_replica=64, max_imbalance=4)
    loads = {"a": 0, "b": 0, "c": 0}
    first = router.route(SYSTEM + [1, 2, 3], loads)
    loads[first] += 1
    for tail in range(10, 13):  # the same system prompt, other questions: the replica that has it
        assert router.route(SYSTEM + [tail] * 20, loads) == first
        loads[first] += 1
    other = router.route(list(range(500, 580)), loads)  # nothing in common: the least loaded
    assert other != first and loads[other] == 0
    assert router.records[first].predicted_hit_rate > 0.5 and router.records[other].matched_blocks == 0


def test_load_wins_when_the_cached_replica_is_too_far_ahead():
    router = PrefixAwareRouter(["a", "b"], block_size=16, blocks_per_replica=64, max_imbalance=2)
    assert router.route(SYSTEM, {"a": 0, "b": 0}) == "a"
    assert router.route(SYSTEM, {"a": 2, "b": 0}) == "a"  # 2 above the least: still within the imbalance
    assert router.route(SYSTEM, {"a": 3, "b": 0}) == "b"  # 3 above: the least loaded takes it
    assert router.route(SYSTEM, {"a": 3, "b": 1}) in ("a", "b")  # both hold it now
    assert router.route(SYSTEM, {"b": 5}) == "b"  # a replica without a reported load is not chosen


def test_the_record_forgets_least_recently_used_blocks_and_a_replaced_replica_starts_empty():
    record = ReplicaRecord(capacity=4)
    old, new = prompt_block_hashes(SYSTEM, 16), prompt_block_hashes(list(range(900, 964)), 16)
    record.add(old)
    assert record.match(old) == 4
    record.add(new[:2])  # two newer blocks push out the two least recently used
    assert record.match(old) == 0 and record.match(new) == 2
    router = PrefixAwareRouter(["a", "b"], block_size=16, blocks_per_replica=64)
    router.route(SYSTEM, {"a": 0, "b": 0})
    router.add_replica("a")
    assert router.records["a"].match(old) == 0 and router.records["a"].routed == 0


def test_bad_router_settings_and_no_replicas_are_one_line_errors():
    with pytest.raises(ValueError, match="none of the known replicas"):  # replicas may come later
        PrefixAwareRouter([], 16, 64).route(SYSTEM, {})
    with pytest.raises(ValueError, match="block_size and blocks_per_replica"):
        PrefixAwareRouter(["a"], 0, 64)
    with pytest.raises(ValueError, match="none of the known replicas"):
        PrefixAwareRouter(["a"], 16, 64).route(SYSTEM, {"z": 0})


def test_rank_puts_the_choice_first_then_the_rest_by_load_and_records_nothing():
    router = PrefixAwareRouter(["a", "b", "c"], block_size=16, blocks_per_replica=64, max_imbalance=4)
    router.record("c", SYSTEM)
    assert router.rank(SYSTEM + [1], {"a": 2, "b": 0, "c": 1}) == ["c", "b", "a"]
    assert router.rank(SYSTEM + [1], {"a": 2, "b": 0, "c": 5}) == ["b", "a", "c"]  # c too far ahead
    assert router.records["c"].routed == 1 and router.records["b"].routed == 0
