"""A base for the block manager's state-machine tests: random frees and the reference-count invariant."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import BlockManager


class BlockMachine(RuleBasedStateMachine):
    """``bm`` and ``held`` (sequence name -> the test's model of it) are the subclass's; a sequence in ``held``
    holds blocks in ``bm``."""

    bm: BlockManager
    held: dict

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(sorted(self.held)))
        self.bm.free(name)
        del self.held[name]

    @invariant()
    def references_match_holders_and_the_free_list(self):
        holders = [b for name in self.held for b in self.bm.block_table(name)]
        free = set(self.bm.pool._free)
        for block in self.bm.pool.blocks:
            assert block.ref_count == holders.count(block.block_id) >= 0
            assert (block.ref_count == 0) == (block.block_id in free)
