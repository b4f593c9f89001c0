"""Where a sequence's tokens live in the KV pool: pool slots from positions, through block tables (and a
window's ring of blocks, ``kvstore.ring``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.ring import RingSpec, table_columns


def batch_slots(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int,
                rings: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Pool slots ``(tokens,)`` int64 of tokens at ``positions[i]`` of the sequence whose blocks are
    ``block_tables[rows[i]]`` (``block_tables`` ``(seqs, width)``); with ``rings`` ``(tokens, 4)``, each
    token's sequence's ring row (``kvstore.ring``), through which logical blocks map to table columns.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size`` in the pool flattened to
    ``[num_blocks * block_size, ...]``; the one place this layout is spelled out in Python (the kernels
    index the same layout with tensors).
    """
    columns = positions // block_size if rings is None else table_columns(positions, rings, block_size)
    blocks = block_tables[rows, columns].astype(np.int64)
    return blocks * block_size + positions % block_size


def token_slots(block_table: Sequence[int] | np.ndarray, start: int, end: int, block_size: int,
                ring: RingSpec | None = None) -> np.ndarray:  # fmt: skip
    """Pool slots ``(end - start,)`` int64 of positions ``start..end-1`` of one sequence (see ``batch_slots``)."""
    positions = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64).reshape(1, -1)
    rings = None if ring is None else np.tile(np.asarray(ring.kernel_row(), dtype=np.int64), (end - start, 1))
    return batch_slots(table, np.zeros_like(positions), positions, block_size, rings)
