"""The ring's geometry (``kvstore.ring``) and the block manager's rings: a ring never holds more than its
blocks, reuses its own oldest slot in place, never writes over a block it shares, and never leaves a slot
it reuses findable in the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import BlockManager, token_slots
from kvstore.ring import RingSpec, sink_query_positions, table_columns


@pytest.mark.parametrize("sinks,window,block_size", [(4, 1020, 16), (0, 16, 4), (3, 12, 4), (5, 9, 8), (1, 2, 1)])
def test_a_chunk_never_overwrites_a_key_its_own_queries_read(sinks, window, block_size):
    """From every start, the blocks from the first one the chunk's first query reads (past the sinks) to the
    chunk's last are distinct ring slots, and the chunk is at least ``chunk_tokens`` long."""
    ring = RingSpec(sinks, window, block_size)
    for start in range(0, 6 * (window + ring.chunk_tokens)):
        n = ring.max_chunk(start)
        assert n >= ring.chunk_tokens
        first = max(ring.sink_blocks, (start - window + 1) // block_size)
        blocks = range(first, (start + n - 1) // block_size + 1)
        slots = [ring.table_index(j) for j in blocks]
        assert len(set(slots)) == len(slots) and all(ring.sink_blocks <= s < ring.max_blocks for s in slots)


def test_geometry_of_the_benchmarks_ring():
    ring = RingSpec(4, 1020, 16)
    assert (ring.sink_blocks, ring.chunk_tokens, ring.ring_blocks, ring.max_blocks) == (1, 255, 81, 82)
    assert ring.num_exact_tokens == 1024
    assert [ring.table_index(j) for j in (0, 1, 81, 82, 163)] == [0, 1, 81, 1, 1]


def test_slots_and_sink_query_positions_follow_the_ring():
    ring = RingSpec(2, 8, 4)  # 1 sink block, a ring of 4: logical block 5 is slot 1 again
    table = [10, 11, 12, 13, 14]
    assert token_slots(table, 18, 22, 4, ring).tolist() == [4 * 14 + 2, 4 * 14 + 3, 4 * 11, 4 * 11 + 1]
    assert token_slots(table, 0, 3, 4, ring).tolist() == [40, 41, 42]
    rows = np.tile(np.asarray(ring.kernel_row()), (4, 1))
    assert table_columns(np.array([3, 4, 20, 21]), rows, 4).tolist() == [0, 1, 1, 1]
    assert sink_query_positions(np.array([0, 8, 9, 10, 500]), rows[[0] * 5]).tolist() == [0, 8, 9, 9, 9]


def test_a_ring_stops_growing_and_reuses_its_oldest_slot_in_place():
    manager, ring = BlockManager(10, 4), RingSpec(2, 8, 4)  # at most 1 + 4 blocks
    assert manager.allocate("s", 12, ring=ring)
    assert manager.block_table("s") == [0, 1, 2]
    assert manager.allocate("s", 20)
    table = manager.block_table("s")
    assert table == [0, 1, 2, 3, 4] and manager.num_free_blocks == 5
    for length in range(21, 200, 3):
        assert manager.num_new_blocks_needed("s", length) == 0
        assert manager.allocate("s", length) and manager.block_table("s") == table
    assert manager.num_free_blocks == 5
    manager.free("s")
    assert manager.num_free_blocks == 10


def test_a_reused_slot_leaves_the_prefix_cache():
    manager, ring = BlockManager(10, 4, enable_caching=True), RingSpec(2, 8, 4)  # exact below 10 tokens: 2 blocks
    tokens = list(range(100, 140))
    manager.allocate("s", 20, ring=ring)
    manager.cache_full_blocks("s", tokens, 20)
    stored, _ = manager.take_events()
    assert len(stored) == 2  # blocks 0 and 1 (below sinks + window); block 2 on is the ring's own KV
    assert len(manager.match_prefix(tokens[:21])) == 2
    manager.allocate("s", 21)  # logical block 5: slot 1, which held cached logical block 1
    assert manager.take_events() == ([], [stored[1]])
    assert len(manager.match_prefix(tokens[:21])) == 1


def test_a_reused_slot_shared_with_another_sequence_is_replaced():
    manager, ring = BlockManager(7, 4, enable_caching=True), RingSpec(2, 8, 4)
    tokens = list(range(100, 140))
    manager.allocate("plain", 12)
    manager.cache_full_blocks("plain", tokens, 12)
    cached = manager.match_prefix(tokens[:30], ring)
    assert [b.block_id for b in cached] == [0, 1]  # below sinks + window only
    assert manager.allocate("ring", 20, cached, ring)
    assert manager.block_table("ring") == [0, 1, 3, 4, 5] and manager.num_free_blocks == 1
    assert manager.allocate("ring", 21)  # slot 1 is "plain"'s block 1: the ring takes block 6 instead
    assert manager.block_table("ring") == [0, 6, 3, 4, 5] and manager.block_table("plain") == [0, 1, 2]
    assert manager.num_free_blocks == 0 and manager.pool.blocks[1].ref_count == 1


def test_a_replacement_that_does_not_fit_changes_nothing():
    manager, ring = BlockManager(6, 4, enable_caching=True), RingSpec(2, 8, 4)
    tokens = list(range(100, 140))
    manager.allocate("plain", 12)
    manager.cache_full_blocks("plain", tokens, 12)
    assert manager.allocate("ring", 20, manager.match_prefix(tokens[:30], ring), ring)
    before = manager.block_table("ring")
    assert before == [0, 1, 3, 4, 5] and manager.num_free_blocks == 0
    assert manager.num_new_blocks_needed("ring", 21) == 1 and not manager.allocate("ring", 21)
    assert manager.block_table("ring") == before
    manager.free("plain")  # the ring holds block 1 alone now: its slot is reused in place, uncached
    assert manager.allocate("ring", 21) and manager.block_table("ring") == before
    assert len(manager.match_prefix(tokens[:30], ring)) == 1  # block 0 (the sinks) still; block 1 no more


def test_a_decode_batch_with_rings_allocates_in_batch_order():
    manager, ring = BlockManager(8, 4), RingSpec(2, 8, 4)
    manager.allocate("a", 20, ring=ring)  # full ring: 5 blocks
    manager.allocate("b", 4)
    manager.allocate("c", 4)
    grown, starved = manager.allocate_decode(["a", "b", "c"], [21, 5, 5])
    assert (grown, starved) == ([1], [2])  # "a" reuses a slot of its own; "b" takes the last block
    assert manager.block_table("a") == [0, 1, 2, 3, 4] and manager.num_free_blocks == 0
