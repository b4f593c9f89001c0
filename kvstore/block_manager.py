"""Which sequence holds which blocks of the KV pool."""

from __future__ import annotations

from kvstore.block_pool import Block, BlockPool


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of token positions ``start..end-1`` of a sequence whose blocks are ``block_table``.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size`` in the pool flattened to
    ``[num_blocks * block_size, ...]``; the one place this layout is spelled out in Python (the kernels
    index the same layout with tensors).
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockManager:
    """Maps each sequence id to the ordered list of blocks holding its KV.

    Token ``i`` of a sequence lives in block ``table[i // block_size]`` at
    offset ``i % block_size`` (``token_slots`` turns that into pool slots).
    Allocation is all-or-nothing: a call that cannot be satisfied changes
    nothing. Freeing releases a sequence's blocks in reverse order, so its
    tail blocks are reused first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[Block]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``seq_id`` has slots for its first ``num_tokens`` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(seq_id, num_tokens) <= self.pool.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to cover ``num_tokens`` tokens; False (and no change) if blocks run out."""
        needed = self.num_new_blocks_needed(seq_id, num_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        self._tables.setdefault(seq_id, []).extend(self.pool.get_free_blocks(needed))
        return True

    def block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(seq_id, ())]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> None:
        """Release every block of ``seq_id`` (a no-op for an unknown id)."""
        blocks = self._tables.pop(seq_id, [])
        self.pool.release(list(reversed(blocks)))

    def rename(self, seq_id: str, new_id: str) -> None:
        """Move ``seq_id``'s blocks to ``new_id`` (e.g. to quarantine blocks a late writer may still touch)."""
        if new_id in self._tables:
            raise ValueError(f"{new_id!r} already holds blocks")
        self._tables[new_id] = self._tables.pop(seq_id)
