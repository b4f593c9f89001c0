"""A fixed set of KV blocks with reference counts and a free list."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One page of the KV pool: ``block_size`` token slots in every layer.

    ``block_hash`` is reserved for prefix caching (a full block's chained hash);
    it stays ``None`` until that is built.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Owns every block; hands out free ones and takes them back.

    Invariants:
    * a block is in the free list if and only if its ``ref_count`` is 0;
    * ``ref_count`` is never negative;
    * the free list is ordered: ``get_free_blocks`` takes from the front and
      ``release`` appends at the back, so the least recently freed block is
      reused first (this is the order a prefix cache will evict in).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_free_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks off the front of the free list, each with ``ref_count`` 1."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks but only {len(self._free)} are free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            block.ref_count = 1
            taken.append(block)
        return taken

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; blocks that reach 0 go to the back of the free list."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} released more times than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
