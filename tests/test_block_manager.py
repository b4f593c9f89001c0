"""Block pool and block manager: exact allocation order, and invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import BlockManager, BlockPool, token_slots


def test_blocks_come_from_the_front_and_return_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("b", 4)
    assert bm.block_table("b") == [3]
    assert bm.allocate("a", 12)  # still 3 blocks: nothing new
    assert bm.block_table("a") == [0, 1, 2]
    assert token_slots(bm.block_table("a"), 3, 6, bm.block_size) == [0 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]
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


def test_pool_refuses_double_release_and_overdraw():
    pool = BlockPool(2)
    blocks = pool.get_free_blocks(2)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_free_blocks(1)
    pool.release(blocks)
    with pytest.raises(ValueError, match="released more times"):
        pool.release(blocks[:1])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences; a model of expected token capacity runs alongside."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.tokens: dict[str, int] = {}

    @rule(seq=st.sampled_from("abcdefg"), grow=st.integers(1, 30))
    def allocate(self, seq, grow):
        want = self.tokens.get(seq, 0) + grow
        free_before = self.bm.num_free_blocks
        could = self.bm.can_allocate(seq, want)
        ok = self.bm.allocate(seq, want)
        assert ok == could
        if ok:
            self.tokens[seq] = want
            assert len(self.bm.block_table(seq)) == -(-want // 4)
        else:
            assert self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @invariant()
    def no_block_both_free_and_used(self):
        used = [b for seq in self.tokens for b in self.bm.block_table(seq)]
        assert len(used) == len(set(used)), "a block is owned twice"
        free = set(self.bm.pool._free)
        assert not free & set(used)
        assert len(free) + len(used) == self.bm.num_blocks
        for block in self.bm.pool.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in free)

    def teardown(self):
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.pool.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
