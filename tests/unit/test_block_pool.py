"""``kvstore.block_pool`` through the block manager: reference counts, the LRU free list that is also the
eviction order (tail blocks first), the prefix cache's hash -> block map with its stored/evicted events, and
a hit confirmed by token ids, never by a hash alone; with invariants under random operation sequences."""

from __future__ import annotations

import pytest
from block_testing import BlockMachine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvstore import BlockManager, BlockPool, block_manager
from kvstore.prefix_hash import block_hashes


def test_pool_refuses_double_release_and_overdraw():
    pool = BlockPool(2)
    blocks = pool.get_free_blocks(2)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_free_blocks(1)
    pool.release(blocks)
    with pytest.raises(ValueError, match="released more times"):
        pool.release(blocks[:1])


TOKENS = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial one


def _caching(num_blocks: int, block_size: int = 4) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_caching=True, salt="layout")


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_cached_blocks_are_shared_then_evicted_least_recently_used_tail_first():
    bm = _caching(num_blocks=6)
    assert bm.allocate("a", 10)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.match_prefix(TOKENS) == []  # allocated but not computed: not findable
    bm.cache_full_blocks("a", TOKENS, 10)
    h0, h1 = block_hashes(TOKENS[:8], 4, "layout")
    assert bm.take_events() == ([h0, h1], []) and bm.take_events() == ([], [])
    assert _ids(bm.match_prefix(TOKENS)) == [0, 1]
    assert _ids(bm.match_prefix(TOKENS[:8])) == [0]  # a whole cached prompt still computes its last token
    assert _ids(bm.match_prefix([100, 101, 102, 999, 0])) == []

    cached = bm.match_prefix(TOKENS)
    assert bm.allocate("b", 12, cached)
    assert bm.block_table("b") == [0, 1, 3] and bm.num_cached_tokens("b") == 8
    assert [b.ref_count for b in bm.pool.blocks] == [2, 2, 1, 1, 0, 0]
    bm.free("a")  # 2 is free; 1 and 0 stay for "b"
    assert list(bm.pool._free) == [4, 5, 2]
    bm.free("b")  # tail first: 3, then 1, then 0
    assert list(bm.pool._free) == [4, 5, 2, 3, 1, 0]
    assert bm.num_free_blocks == 6 and sorted(bm.cached_block_hashes()) == sorted([h0, h1])

    assert bm.allocate("c", 16) and bm.block_table("c") == [4, 5, 2, 3]  # uncached blocks first in LRU order
    assert bm.take_events() == ([], [])
    assert bm.allocate("d", 1) and bm.block_table("d") == [1]  # evicts the tail of the cached prefix
    assert bm.take_events() == ([], [h1])
    assert _ids(bm.match_prefix(TOKENS)) == [0]
    assert bm.allocate("e", 10, bm.match_prefix(TOKENS)) is False  # needs 0 (free, cached) plus 2 new: 1 free
    assert bm.block_table("e") == [] and bm.pool.blocks[0].ref_count == 0


def test_reviving_a_cached_free_block_counts_against_the_free_list():
    bm = _caching(num_blocks=3)
    assert bm.allocate("a", 8)
    bm.cache_full_blocks("a", TOKENS, 8)
    bm.free("a")
    hit = bm.match_prefix(TOKENS)
    assert _ids(hit) == [0, 1]
    assert bm.num_new_blocks_needed("b", 12, hit) == 3 and bm.can_allocate("b", 12, hit)
    assert not bm.can_allocate("b", 13, hit)
    assert bm.allocate("b", 12, hit) and bm.block_table("b") == [0, 1, 2] and bm.num_free_blocks == 0


def test_an_unfilled_allocation_is_never_cached_and_caching_off_hashes_nothing():
    bm = _caching(num_blocks=4)
    assert bm.allocate("reserved", 10)
    bm.free("reserved")
    assert bm.cached_block_hashes() == [] and bm.match_prefix(TOKENS) == []
    off = BlockManager(4, 4)
    assert off.allocate("a", 10)
    off.cache_full_blocks("a", TOKENS, 10)
    off.free("a")
    assert off.cached_block_hashes() == [] and off.match_prefix(TOKENS) == [] and off.take_events() == ([], [])


def test_stored_then_evicted_before_a_take_is_reported_in_neither_list():
    bm = _caching(num_blocks=2)
    assert bm.allocate("a", 8)
    bm.cache_full_blocks("a", TOKENS, 8)
    bm.free("a")
    assert bm.allocate("b", 8)  # evicts both
    assert bm.take_events() == ([], []) and bm.cached_block_hashes() == []
    bm.cache_full_blocks("b", TOKENS, 8)
    stored, _ = bm.take_events()
    bm.free("b")
    assert bm.allocate("c", 8)
    bm.cache_full_blocks("c", TOKENS, 8)  # evicted, then stored again: no net change
    assert bm.take_events() == ([], []) and sorted(bm.cached_block_hashes()) == sorted(stored)


def _position_only_hashes(token_ids, block_size, salt, parent=""):
    """A hash that ignores the tokens: every prompt collides with every other, block by block."""
    return [parent + "x" for _ in range(len(token_ids) // block_size)]


def test_a_hash_collision_never_serves_another_prefixs_kv(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hashes", _position_only_hashes)
    bm = _caching(num_blocks=8, block_size=2)
    other = [7, 7, 5, 5, 0]  # block 1 equals ours, block 0 does not
    ours = [1, 1, 5, 5, 0]
    assert bm.allocate("other", 5)
    bm.cache_full_blocks("other", other, 4)
    assert bm.match_prefix(ours) == []  # same hash, different tokens
    # Evict only the first block of "other": its second block stays cached under the colliding hash.
    second = bm.pool.blocks[bm.block_table("other")[1]]
    bm.free("other")
    bm.pool.touch([second])
    assert bm.allocate("filler", 2 * 7) and bm.match_prefix(other) == []
    bm.free("filler")
    bm.pool.release([second])  # now the most recently used: "ours" will not evict it
    assert second.block_hash is not None
    assert bm.allocate("ours", 5)
    bm.cache_full_blocks("ours", ours, 4)
    # Same hash and same tokens as ``second``, but computed after another first block: not a hit.
    assert _ids(bm.match_prefix(ours)) == bm.block_table("ours")[:2]
    assert second.block_hash is None


class PrefixCacheMachine(BlockMachine):
    """Random admit (match + allocate) / compute / free sequences over a small caching pool, with token
    sequences from a two-letter alphabet so prefixes are shared, optionally under a hash that always
    collides. A shadow of each block's KV (the token prefix it was computed for) checks every hit."""

    BLOCK_SIZE = 2

    def __init__(self):
        super().__init__()
        self.bm = _caching(num_blocks=10, block_size=self.BLOCK_SIZE)
        self.held: dict[str, tuple[list[int], int]] = {}  # name -> (tokens, num computed)
        self.kv: dict[int, tuple[int, ...]] = {}
        self.index: set[str] = set()  # a prefix index fed only by the events
        self.restore = block_manager.block_hashes

    @initialize(colliding=st.booleans())
    def choose_hash(self, colliding):
        if colliding:
            block_manager.block_hashes = _position_only_hashes

    def _compute(self, name: str, tokens: list[int], start: int, end: int) -> None:
        table, bs = self.bm.block_table(name), self.BLOCK_SIZE
        for i in range(start // bs, -(-end // bs)):
            assert self.bm.pool.blocks[table[i]].ref_count == 1, "wrote into a shared block"
            self.kv[table[i]] = tuple(tokens[: min((i + 1) * bs, end)])
        self.bm.cache_full_blocks(name, tokens, end)
        self.held[name] = (tokens, end)

    @rule(name=st.sampled_from("abcde"), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12),
          data=st.data())  # fmt: skip
    def admit(self, name, tokens, data):
        if name in self.held:
            return
        cached = self.bm.match_prefix(tokens)
        num_cached = len(cached) * self.BLOCK_SIZE
        assert num_cached < len(tokens)
        for i, block in enumerate(cached):
            assert self.kv[block.block_id] == tuple(tokens[: (i + 1) * self.BLOCK_SIZE]), "a hit served other KV"
        end = num_cached + data.draw(st.integers(1, len(tokens) - num_cached))
        free_before = self.bm.num_free_blocks
        if self.bm.allocate(name, end, cached):
            assert self.bm.block_table(name)[: len(cached)] == _ids(cached)
            self._compute(name, tokens, num_cached, end)
        else:
            assert not self.bm.has(name) and self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.held)
    @rule(data=st.data(), grow=st.integers(1, 6))
    def compute(self, data, grow):
        name = data.draw(st.sampled_from(sorted(self.held)))
        tokens, done = self.held[name]
        end = min(len(tokens), done + grow)
        if self.bm.allocate(name, end):
            self._compute(name, tokens, done, end)

    @invariant()
    def the_hash_map_and_the_event_fed_index_agree(self):
        for block_hash, block in self.bm.pool.cached.items():
            assert block.block_hash == block_hash
        assert sum(b.block_hash is not None for b in self.bm.pool.blocks) == len(self.bm.pool.cached)
        stored, evicted = self.bm.take_events()
        assert not set(stored) & set(evicted)
        self.index = (self.index | set(stored)) - set(evicted)
        assert self.index == set(self.bm.cached_block_hashes())

    def teardown(self):
        block_manager.block_hashes = self.restore
        for name in list(self.held):
            self.bm.free(name)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.pool.blocks)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
