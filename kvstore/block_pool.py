"""A fixed set of KV blocks with reference counts, an LRU free list and the prefix cache's hash -> block map."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One page of the KV pool: ``block_size`` token slots in every layer.

    A *cached* block holds the KV of a full block of some token sequence and is findable by its chained hash:
    ``block_hash`` (``kvstore.prefix_hash``), the block's own ``token_ids`` and ``content_id``, a number
    unique for the life of the pool that names exactly the token prefix the KV was computed for (the chain of
    ``parent_content_id`` back to the first block, whose parent is 0, plus each block's ``token_ids``).
    Comparing those, not only the hash, is what makes a hit exact. ``parent_hash`` is the hash of the block
    before it ('' for a first block): what a lower tier, which keeps no content ids, compares instead. All
    are unset (``None``/0/'') on a block that is not cached.
    """

    block_id: int
    ref_count: int = 0
    block_hash: str | None = None
    token_ids: tuple[int, ...] | None = None
    content_id: int | None = None
    parent_content_id: int = 0
    parent_hash: str = ""


@dataclass(frozen=True)
class Evicted:
    """A cached block that ``get_free_blocks`` handed out again: what it held, and where, until the new owner
    writes over it (a lower tier copies it out before that; see ``BlockPool.take_evicted``)."""

    block_id: int
    block_hash: str
    parent_hash: str
    token_ids: tuple[int, ...]


class BlockPool:
    """Owns every block; hands out free ones, takes them back and remembers which hold cached KV.

    Invariants:
    * a block is in the free list if and only if its ``ref_count`` is 0; ``ref_count`` is never negative;
    * the free list is the LRU order: ``get_free_blocks`` takes from the front (the least recently used) and
      ``release`` appends at the back; a cached block that is freed keeps its hash and stays findable;
    * ``cached`` maps each hash to at most one block, and a block is in it iff its ``block_hash`` is set;
      a cached block leaves it (is evicted) only when ``get_free_blocks`` hands it out again;
    * a block with ``ref_count`` > 0 is never evicted.

    Prefix events (``take_events``) are the *net* change of the set of cached hashes since the last take: a
    hash stored and evicted in between appears in neither list (likewise evicted then stored again), so
    applying the two lists in any order brings a copy of the set up to date.

    With ``record_evictions`` every eviction is also recorded (``take_evicted``), for a lower tier to copy the
    block out before its new owner writes over it.
    """

    def __init__(self, num_blocks: int, *, record_evictions: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[str, Block] = {}
        self._content_ids = itertools.count(1)
        self._pending: dict[str, bool] = {}  # hash -> cached now; only hashes that changed since the last take
        self.record_evictions = record_evictions
        self._evicted: list[Evicted] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included (they are reclaimed on demand)."""
        return len(self._free)

    def get_free_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks off the front of the free list, each with ``ref_count`` 1, evicting cached ones."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks but only {len(self._free)} are free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self.record_evictions:
                    self._evicted.append(Evicted(block.block_id, block.block_hash, block.parent_hash, block.token_ids))
                del self.cached[block.block_hash]
                self._note(block.block_hash, cached=False)
                _forget(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each (cached) block, taking those nobody used off the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks that reach 0 go to the back of the free list."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} released more times than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: str, token_ids: tuple[int, ...], parent_content_id: int) -> Block | None:
        """The cached block holding exactly this block of tokens after exactly this prefix, if any."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_content_id != parent_content_id:
            return None
        return block

    def cache(self, block: Block, block_hash: str, token_ids: tuple[int, ...], parent_content_id: int,
              parent_hash: str = "") -> int:  # fmt: skip
        """Record that ``block`` (referenced, its KV computed) holds ``token_ids`` after the prefix
        ``parent_content_id`` (whose last block's hash is ``parent_hash``); return the content id that now
        names that prefix.

        When an equal block is already cached, that one stays and its content id is returned (``block`` stays
        uncached: a duplicate). A different block under the same hash (a collision, or a stale chain whose
        parent was evicted) loses its place to ``block``; the hash stays cached, so no event is emitted.
        """
        existing = self.lookup(block_hash, token_ids, parent_content_id)
        if existing is not None:
            return existing.content_id
        replaced = self.cached.get(block_hash)
        if replaced is None:
            self._note(block_hash, cached=True)
        else:
            _forget(replaced)
        block.block_hash, block.token_ids, block.parent_content_id = block_hash, token_ids, parent_content_id
        block.parent_hash = parent_hash
        block.content_id = next(self._content_ids)
        self.cached[block_hash] = block
        return block.content_id

    def uncache(self, block: Block) -> None:
        """Make ``block`` unfindable now, as an eviction: its one owner (a ring: ``kvstore.ring``) is about to
        write other KV into it. A no-op for a block that is not cached."""
        if block.block_hash is None:
            return
        if block.ref_count != 1:
            raise ValueError(f"block {block.block_id} has {block.ref_count} owners: only its one owner may uncache it")
        if self.record_evictions:
            self._evicted.append(Evicted(block.block_id, block.block_hash, block.parent_hash, block.token_ids))
        del self.cached[block.block_hash]
        self._note(block.block_hash, cached=False)
        _forget(block)

    def take_events(self) -> tuple[list[str], list[str]]:
        """(hashes stored, hashes evicted) since the last call: the net change, see the class docstring."""
        stored = [h for h, cached in self._pending.items() if cached]
        evicted = [h for h, cached in self._pending.items() if not cached]
        self._pending.clear()
        return stored, evicted

    def take_evicted(self) -> list[Evicted]:
        """The evictions since the last call, oldest first (only with ``record_evictions``)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _note(self, block_hash: str, cached: bool) -> None:
        if self._pending.get(block_hash) is (not cached):
            del self._pending[block_hash]  # back to what it was at the last take
        else:
            self._pending[block_hash] = cached


def _forget(block: Block) -> None:
    block.block_hash, block.token_ids, block.content_id, block.parent_content_id = None, None, None, 0
    block.parent_hash = ""
