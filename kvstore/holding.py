"""One sequence's hold on the KV pool (``BlockManager``'s record of it): its blocks, its block table as an
int32 array, and the prefix-cache chain of its leading full blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.block_pool import Block
from kvstore.ring import RingSpec

EMPTY_TABLE = np.empty(0, dtype=np.int32)
EMPTY_TABLE.flags.writeable = False


@dataclass
class Holding:
    """One sequence's blocks, and the prefix-cache chain of its leading full blocks.

    ``hashes[i]`` and ``content_ids[i]`` name the prefix through block ``i`` for every block ``i`` already
    cached (``content_ids[i]`` may name an equal block another sequence computed first); they grow together.
    ``table[:len(blocks)]`` holds the blocks' ids (its capacity doubles, so appending is amortized O(1)) and
    ``view`` is that slice, read-only, remade only when blocks are added.
    """

    blocks: list[Block] = field(default_factory=list)
    table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    view: np.ndarray = field(default_factory=lambda: EMPTY_TABLE)
    hashes: list[str] = field(default_factory=list)
    content_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    ring: RingSpec | None = None  # its blocks form a ring (``BlockManager``'s ring section)
    num_logical_blocks: int = 0  # (a ring) logical blocks covered so far, past its table's length once it wraps

    def extend(self, blocks: Sequence[Block]) -> None:
        have, need = len(self.blocks), len(self.blocks) + len(blocks)
        if need > len(self.table):
            grown = np.empty(max(need, 2 * len(self.table), 4), dtype=np.int32)
            grown[:have] = self.table[:have]
            self.table = grown
        self.table[have:need] = [b.block_id for b in blocks]
        self.blocks.extend(blocks)
        self.view = self.table[:need]
        self.view.flags.writeable = False

    def truncate(self, keep: int) -> list[Block]:
        """Drop the blocks past the first ``keep`` and return them. The table gets new memory, so that arrays
        handed out before keep their entries."""
        released = self.blocks[keep:]
        del self.blocks[keep:]
        self.table = self.table[:keep].copy()
        self.view = self.table[:keep]
        self.view.flags.writeable = False
        return released
