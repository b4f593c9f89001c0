"""``kvstore.block_manager``: exact allocation order, all-or-nothing allocation, block tables that grow in place,
and invariants under random operation sequences. The prefix cache's blocks: tests/unit/test_block_pool.py."""

from __future__ import annotations

import pytest
from block_testing import BlockMachine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvstore import BlockManager, token_slots


def test_blocks_come_from_the_front_and_return_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("b", 4)
    assert bm.block_table("b") == [3]
    assert bm.allocate("a", 12)  # still 3 blocks: nothing new
    assert bm.block_table("a") == [0, 1, 2]
    assert token_slots(bm.block_table("a"), 3, 6, bm.block_size).tolist() == [0 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]
    bm.free("a")  # released tail first: 2, 1, 0 join the back of the free list after 4, 5
    assert bm.allocate("c", 20)
    assert bm.block_table("c") == [4, 5, 2, 1, 0]


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.allocate("a", 40)
    assert not bm.can_allocate("b", 33)
    assert not bm.allocate("b", 33)
    assert not bm.has("b") and bm.num_free_blocks == 1
    assert bm.allocate("b", 16)


def test_block_table_arrays_grow_in_place_and_old_views_never_change():
    bm = BlockManager(num_blocks=40, block_size=4)
    assert bm.allocate("a", 4)
    first = bm.block_table_array("a")
    for num_tokens in range(8, 121, 4):  # one block per call, through several capacity doublings
        assert bm.allocate("a", num_tokens)
    assert first.tolist() == [0]
    assert bm.block_table_array("a").tolist() == bm.block_table("a") == list(range(30))
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 5
    bm.free("a")
    assert bm.block_table_array("a").tolist() == []


def test_allocate_decode_gives_blocks_in_batch_order_as_one_allocate_each_would():
    bm = BlockManager(num_blocks=8, block_size=4)
    for seq, num_tokens in (("a", 4), ("b", 3), ("c", 8), ("x", 8)):  # a [0], b [1], c [2, 3], x [4, 5]
        assert bm.allocate(seq, num_tokens)
    bm.free("x")  # free list now 6, 7, 5, 4
    a_before = bm.block_table_array("a")
    assert bm.allocate_decode(["a", "b", "c"], [5, 4, 9]) == ([0, 2], [])  # b's block still has room
    assert [bm.block_table(s) for s in "abc"] == [[0, 6], [1], [2, 3, 7]]
    assert a_before.tolist() == [0] and bm.block_table_array("a").tolist() == [0, 6]
    # 5 then 4 are left: b and a get them, c (listed last) finds none and is left as it was
    assert bm.allocate_decode(["b", "a", "c"], [5, 9, 13]) == ([0, 1], [2])
    assert [bm.block_table(s) for s in "abc"] == [[0, 6, 4], [1, 5], [2, 3, 7]]
    assert bm.num_free_blocks == 0
    bm.free("b")  # 5, 1
    assert bm.allocate_decode(["c"], [13]) == ([0], [])
    assert bm.block_table("c") == [2, 3, 7, 5]


def test_allocate_decode_stops_at_the_first_sequence_that_does_not_fit():
    bm = BlockManager(num_blocks=6, block_size=4)
    for seq in "abc":
        assert bm.allocate(seq, 4)  # a [0], b [1], c [2]; free 3, 4, 5
    # a needs 2 (fits), b needs 2 (1 left: does not), c needs 1 (would fit, but comes after b)
    assert bm.allocate_decode(["a", "b", "c"], [12, 12, 8]) == ([0], [1, 2])
    assert [bm.block_table(s) for s in "abc"] == [[0, 3, 4], [1], [2]]
    assert bm.num_free_blocks == 1
    with pytest.raises(KeyError):
        bm.allocate_decode(["nobody"], [1])


class BlockManagerMachine(BlockMachine):
    """Random allocate/grow/free sequences; a model of expected token capacity runs alongside."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.held: dict[str, int] = {}

    @rule(seq=st.sampled_from("abcdefg"), grow=st.integers(1, 30))
    def allocate(self, seq, grow):
        want = self.held.get(seq, 0) + grow
        free_before = self.bm.num_free_blocks
        could = self.bm.can_allocate(seq, want)
        ok = self.bm.allocate(seq, want)
        assert ok == could
        if ok:
            self.held[seq] = want
            assert len(self.bm.block_table(seq)) == -(-want // 4)
        else:
            assert self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def decode_step(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        want = [self.held[seq] + data.draw(st.integers(1, 6)) for seq in seqs]
        free_before = self.bm.num_free_blocks
        needing = [i for i, seq in enumerate(seqs) if -(-want[i] // 4) > len(self.bm.block_table(seq))]
        grown, starved = self.bm.allocate_decode(seqs, want)
        assert grown + starved == needing  # a prefix of the needing ones is served
        assert free_before - self.bm.num_free_blocks == sum(-(-want[i] // 4) - -(-self.held[seqs[i]] // 4)
                                                            for i in grown)  # fmt: skip
        for i, seq in enumerate(seqs):
            if i not in starved:
                self.held[seq] = want[i]
            assert len(self.bm.block_table(seq)) == -(-self.held[seq] // 4)

    @invariant()
    def no_block_is_owned_twice(self):
        used = [b for seq in self.held for b in self.bm.block_table(seq)]
        assert len(used) == len(set(used)), "a block is owned twice"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
