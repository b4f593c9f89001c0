"""Which sequence holds which blocks of the KV pool, and which of them it found in the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.block_pool import Block, BlockPool, Evicted
from kvstore.holding import EMPTY_TABLE, Holding
from kvstore.prefix_hash import block_hashes
from kvstore.ring import RingSpec


class BlockManager:
    """Maps each sequence id to the ordered list of blocks holding its KV, sharing cached prefix blocks.

    Token ``i`` of a sequence lives in block ``table[i // block_size]`` at offset ``i % block_size``
    (``kvstore.slots.token_slots`` turns that into pool slots). Allocation is all-or-nothing: a call that cannot be
    satisfied changes nothing. Freeing releases one reference to each of a sequence's blocks in reverse
    order, so its tail blocks are reused (evicted) first; a block another sequence shares stays.

    With ``enable_caching``, ``match_prefix`` finds the longest run of cached full blocks a token sequence
    starts with, ``allocate(..., cached=...)`` makes them a new sequence's first blocks, and
    ``cache_full_blocks`` makes a sequence's blocks findable once their KV is computed. Blocks that are
    allocated but not yet filled are never findable. ``salt`` goes into every hash (the KV layout's
    fingerprint). Without caching nothing is hashed or matched.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False, salt: str = "",
                 record_evictions: bool = False) -> None:  # fmt: skip
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.salt = salt
        self.pool = BlockPool(num_blocks, record_evictions=record_evictions)
        self._holdings: dict[str, Holding] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the prefix cache -----------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], ring: RingSpec | None = None) -> list[Block]:
        """The cached blocks of the longest cached run of full blocks ``token_ids`` starts with, leaving at
        least one token uncovered (its logits are needed). Changes nothing; [] without caching. A sequence with
        a ``ring`` matches only blocks below its window's end, whose KV a full cache has too."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        hits: list[Block] = []
        parent_hash, parent_id = "", 0
        end = len(token_ids) - 1 if ring is None else min(len(token_ids) - 1, ring.num_exact_tokens)
        for start in range(0, end // bs * bs, bs):
            tokens = tuple(token_ids[start : start + bs])
            [parent_hash] = block_hashes(tokens, bs, self.salt, parent_hash)
            block = self.pool.lookup(parent_hash, tokens, parent_id)
            if block is None:
                break
            hits.append(block)
            parent_id = block.content_id
        return hits

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Make ``seq_id``'s blocks that are full within its first ``num_tokens`` tokens (whose KV is
        computed) findable; ``token_ids`` are the sequence's tokens. A no-op without caching."""
        if not self.enable_caching:
            return
        holding = self._holdings.get(seq_id)
        bs = self.block_size
        if holding is not None and holding.ring is not None:  # past its window's end, a ring's KV is its own
            num_tokens = min(num_tokens, holding.ring.num_exact_tokens)
        if holding is None or num_tokens // bs <= len(holding.content_ids):  # no block filled since the last call
            return
        for i in range(len(holding.content_ids), num_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            [block_hash] = block_hashes(tokens, bs, self.salt, holding.hashes[-1] if i else "")
            parent_id, parent_hash = (holding.content_ids[-1], holding.hashes[-1]) if i else (0, "")
            holding.content_ids.append(self.pool.cache(holding.blocks[i], block_hash, tokens, parent_id, parent_hash))
            holding.hashes.append(block_hash)

    def num_cached_tokens(self, seq_id: str) -> int:
        """Tokens of ``seq_id``'s KV that came from the prefix cache when its blocks were first allocated."""
        holding = self._holdings.get(seq_id)
        return 0 if holding is None else holding.num_cached_tokens

    def cached_block_hashes(self) -> list[str]:
        return list(self.pool.cached)

    def take_events(self) -> tuple[list[str], list[str]]:
        """(hashes stored, hashes evicted) since the last call, netted (see ``BlockPool``)."""
        return self.pool.take_events()

    def take_evicted(self) -> list[Evicted]:
        """Cached blocks handed out again since the last call (with ``record_evictions``): a lower tier copies
        them out before their new owners write (``BlockPool.take_evicted``)."""
        return self.pool.take_evicted()

    # -- allocation -----------------------------------------------------------------------------------------

    def num_new_blocks_needed(self, seq_id: str, num_tokens: int, cached: Sequence[Block] = (),
                              ring: RingSpec | None = None) -> int:  # fmt: skip
        """Free blocks ``allocate(seq_id, num_tokens, cached, ring)`` would take off the free list."""
        holding = self._holdings.get(seq_id)
        if holding is not None and holding.ring is not None:
            return self._ring_growth(holding, num_tokens)[0]
        have = len(holding.blocks) if holding is not None else len(cached)
        revived = sum(1 for b in cached if b.ref_count == 0)  # cached blocks nobody uses sit in the free list
        blocks = self.num_blocks_for(num_tokens) if ring is None or holding is not None else ring.num_table_blocks(
            num_tokens)  # fmt: skip
        return max(0, blocks - have) + revived

    def can_allocate(self, seq_id: str, num_tokens: int, cached: Sequence[Block] = (),
                     ring: RingSpec | None = None) -> bool:  # fmt: skip
        return self.num_new_blocks_needed(seq_id, num_tokens, cached, ring) <= self.pool.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, cached: Sequence[Block] = (),
                 ring: RingSpec | None = None) -> bool:  # fmt: skip
        """Grow ``seq_id``'s table to cover ``num_tokens`` tokens; False (and no change) if blocks run out.

        ``cached`` (from ``match_prefix``, for a sequence that holds no blocks yet) become its first blocks,
        shared with whoever else uses them; their tokens count as computed. ``ring`` (for a sequence that holds
        no blocks yet) makes its blocks a ring, which never grows past ``ring.max_blocks`` (the ring section).
        """
        holding = self._holdings.get(seq_id)
        if holding is not None:
            if cached:
                raise ValueError(f"{seq_id!r} already holds blocks; a cached prefix is only for a new sequence")
            if holding.ring is not None:
                return self._grow_ring(holding, num_tokens)
            need = -(-num_tokens // self.block_size) - len(holding.blocks)
            if need > self.pool.num_free_blocks:
                return False
            if need > 0:
                holding.extend(self.pool.get_free_blocks(need))
            return True
        if not self.can_allocate(seq_id, num_tokens, cached, ring):
            return False
        self.pool.touch(cached)
        holding = self._holdings[seq_id] = Holding(
            hashes=[b.block_hash for b in cached],
            content_ids=[b.content_id for b in cached],
            num_cached_tokens=len(cached) * self.block_size,
            ring=ring,
        )
        if ring is not None:
            holding.extend(cached)
            holding.num_logical_blocks = len(cached)
            return self._grow_ring(holding, num_tokens)  # (fits: can_allocate counted it)
        holding.extend([*cached, *self.pool.get_free_blocks(max(0, self.num_blocks_for(num_tokens) - len(cached)))])
        return True

    def allocate_decode(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """A decode step's allocation for a whole batch of sequences that hold blocks: grow ``seq_ids[i]``'s
        table to cover ``num_tokens[i]`` tokens (in a decode step at most one block more).

        The sequences that need blocks get them in batch order from one take off the free list, the same
        blocks in the same order as one ``allocate`` per sequence would give, until one does not fit; it and
        every later one that needs blocks get none and are left unchanged (all-or-nothing per sequence).
        Returns ``(grown, starved)``: indices into ``seq_ids`` of the sequences that took blocks (their
        ``block_table_array`` is a new view) and of those that needed blocks and got none, both ascending.
        """
        bs, holdings = self.block_size, self._holdings
        if any(holdings[seq_id].ring is not None for seq_id in seq_ids):
            return self._allocate_each(seq_ids, num_tokens)
        needs = []  # (index, blocks it needs) of the few that need any: one step in block_size fills a block
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens, strict=True)):
            have = len(holdings[seq_id].blocks)
            if n > have * bs:
                needs.append((i, -(-n // bs) - have))
        free, num_fit = self.pool.num_free_blocks, 0
        for _, need in needs:
            if need > free:
                break
            free -= need
            num_fit += 1
        blocks = self.pool.get_free_blocks(self.pool.num_free_blocks - free)
        taken = 0
        for i, need in needs[:num_fit]:
            holdings[seq_ids[i]].extend(blocks[taken : taken + need])
            taken += need
        return [i for i, _ in needs[:num_fit]], [i for i, _ in needs[num_fit:]]

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release ``seq_id``'s blocks past those its first ``num_tokens`` tokens need (a verify step's rejected
        proposals, ``engine.speculative``), tail first. Those blocks were never cached: a block is cached only
        once its tokens are computed, and rejected tokens never count as computed. The table gets new memory,
        so that arrays handed out before keep their entries (``block_table_array``)."""
        holding = self._holdings[seq_id]
        keep = self.num_blocks_for(num_tokens)
        if holding.ring is not None or keep >= len(holding.blocks):
            return
        assert len(holding.hashes) <= keep, "a cached block past the tokens kept"
        self.pool.release(reversed(holding.truncate(keep)))

    def block_table(self, seq_id: str) -> list[int]:
        holding = self._holdings.get(seq_id)
        return [] if holding is None else holding.table[: len(holding.blocks)].tolist()

    def block_table_array(self, seq_id: str) -> np.ndarray:
        """``seq_id``'s block ids now, ``(num_blocks,)`` int32, without copying (O(1)): a read-only view whose
        entries never change (blocks are only appended, and a freed sequence's array is not reused)."""
        holding = self._holdings.get(seq_id)
        return EMPTY_TABLE if holding is None else holding.view

    def shared_prefix(self, seq_id: str, num_tokens: int) -> list[Block]:
        """``seq_id``'s blocks that hold its first ``num_tokens`` tokens' full blocks, for a sequence that starts
        with the same tokens to share (``allocate(..., cached=...)``; ``engine.parallel_sampling``); the caller
        vouches that their KV is computed. [] for an unknown id or a ring (it overwrites its blocks); with
        caching, only blocks already cached (their hashes go to the sharer's table)."""
        holding = self._holdings.get(seq_id)
        if holding is None or holding.ring is not None:
            return []
        n = min(num_tokens // self.block_size, len(holding.blocks))
        return holding.blocks[: min(n, len(holding.content_ids)) if self.enable_caching else n]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._holdings

    def free(self, seq_id: str) -> None:
        """Release ``seq_id``'s blocks, tail first (a no-op for an unknown id); cached ones stay findable."""
        holding = self._holdings.pop(seq_id, None)
        if holding is not None:
            self.pool.release(reversed(holding.blocks))

    def rename(self, seq_id: str, new_id: str) -> None:
        """Move ``seq_id``'s blocks to ``new_id`` (e.g. to quarantine blocks a late writer may still touch)."""
        if new_id in self._holdings:
            raise ValueError(f"{new_id!r} already holds blocks")
        self._holdings[new_id] = self._holdings.pop(seq_id)

    # -- rings (kvstore.ring) -------------------------------------------------------------------------------
    # A ring holds at most ``ring.max_blocks`` blocks; logical block ``j`` lives at ``ring.table_index(j)``.
    # Entering a logical block past the table reuses the slot of the oldest ring block in place. Before the
    # slot is written over, it is made the sequence's own: a block another sequence shares is replaced by a
    # fresh one (so the table entry changes), and a cached block it alone holds is uncached, so that no prefix
    # lookup ever finds KV the ring has overwritten.

    def _ring_growth(self, holding: Holding, num_tokens: int) -> tuple[int, int, list[int]]:
        """(free blocks needed, blocks to append, table indices to reuse) to cover ``num_tokens`` tokens."""
        ring = holding.ring
        want, have = self.num_blocks_for(num_tokens), holding.num_logical_blocks
        if want <= have:
            return 0, 0, []
        append = max(0, min(want, ring.max_blocks) - len(holding.blocks))
        reuse = sorted({ring.table_index(j) for j in range(max(have, ring.max_blocks), want)})
        shared = sum(1 for i in reuse if i < len(holding.blocks) and holding.blocks[i].ref_count > 1)
        return append + shared, append, reuse

    def _grow_ring(self, holding: Holding, num_tokens: int) -> bool:
        need, append, reuse = self._ring_growth(holding, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        fresh = self.pool.get_free_blocks(need)
        holding.extend(fresh[:append])
        replacements = iter(fresh[append:])
        for i in reuse:
            block = holding.blocks[i]
            if block.ref_count > 1:
                self.pool.release([block])
                holding.blocks[i] = new = next(replacements)
                holding.table[i] = new.block_id
            else:
                self.pool.uncache(block)
        holding.num_logical_blocks = max(holding.num_logical_blocks, self.num_blocks_for(num_tokens))
        return True

    def _allocate_each(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """``allocate_decode`` one sequence at a time (a batch with rings): the same outcome, in batch order."""
        grown, starved = [], []
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens, strict=True)):
            need = self.num_new_blocks_needed(seq_id, n)
            if need and (starved or not self.allocate(seq_id, n)):
                starved.append(i)
            elif need:
                grown.append(i)
            else:
                self.allocate(seq_id, n)  # a ring may reuse a slot of its own without taking a block
        return grown, starved
