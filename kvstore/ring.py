"""The ring buffer of a sequence that attends over a window: StreamingLLM's sinks + recent window, or a
sliding-window model's window.

A *windowed* sequence at position ``t`` attends to its first ``num_sinks`` tokens (positions ``0..S-1``, the
"attention sinks") and its last ``window`` tokens (positions ``t-W+1..t``), nothing else. Keys are stored
rotated at their absolute position; window keys score by their distance to the query, which is their
distance inside the cache too, so only the sinks need the query rotated at its position *inside the cache*
(``sink_query_positions``): the sinks sit at cache positions ``0..S-1`` and the window right after them.

Memory: once the sequence outgrows its cache, its oldest non-sink block is reused in place. The sequence
holds ``sink_blocks`` blocks for the sinks (logical blocks ``0..sink_blocks-1``, never reused) and a ring of
``ring_blocks`` blocks: logical block ``j >= sink_blocks`` lives at table index
``sink_blocks + (j - sink_blocks) % ring_blocks``. The ring holds the window plus the tokens one step computes
(``chunk_tokens``), so that a prefill chunk never overwrites a key one of its own queries still reads; a
step's chunk is capped to fit (``max_chunk``).

A ``RingSpec`` that does not recycle (``recycles=False``) describes a window over a full-length table: the
layers of a model that slide in only some of its layers (Qwen2's ``max_window_layers``), where the other
layers need every key.

The kernels take the same geometry as one int32 row per sequence (``kernel_row``, the layout of
``kvkernels.reference``'s ``ring``); a sequence without a window in a batch that has windowed ones gets
``FULL_RING_ROW``, which sees every key through the identity mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the kernels' per-sequence ring rows: their columns, and the row of a sequence without a window
from kvkernels.reference import FULL_RING_ROW, RING_BLOCKS, RING_SINK_BLOCKS, RING_SINKS, RING_WINDOW, UNBOUNDED

__all__ = ["FULL_RING_ROW", "UNBOUNDED", "RingSpec", "check_streaming", "sink_query_positions", "table_columns"]


@dataclass(frozen=True)
class RingSpec:
    """One sequence's window and the shape of its blocks (see the module's docstring)."""

    num_sinks: int
    window: int
    block_size: int
    recycles: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.num_sinks < self.window:
            raise ValueError(f"a ring needs 0 <= num_sinks < window, got {self.num_sinks} and {self.window}")

    @property
    def chunk_tokens(self) -> int:
        """Tokens one step may compute besides the window the ring keeps: a quarter of the window, at least a
        block (the ring costs ``window + chunk_tokens`` tokens of memory; bigger chunks prefill faster)."""
        return max(self.block_size, self.window // 4)

    @property
    def sink_blocks(self) -> int:
        return -(-self.num_sinks // self.block_size)

    @property
    def ring_blocks(self) -> int:
        """Blocks that hold any ``window + chunk_tokens - 1`` consecutive positions, however they align."""
        if not self.recycles:
            return UNBOUNDED
        return -(-(self.window + self.chunk_tokens - 1) // self.block_size) + 1

    @property
    def max_blocks(self) -> int:
        """The most blocks the sequence ever holds."""
        return self.sink_blocks + self.ring_blocks

    @property
    def num_exact_tokens(self) -> int:
        """Positions below this hold the KV a full cache holds, in the same blocks (prefix-cacheable, loadable
        by a connector): those that see every earlier token, and every position of a model's own window over
        a full table (no sinks, no recycling: the model's KV is windowed whoever computes it)."""
        if not self.recycles and not self.num_sinks:
            return UNBOUNDED
        return self.num_sinks + self.window

    def num_table_blocks(self, num_tokens: int) -> int:
        """Blocks the sequence holds to cover its first ``num_tokens`` tokens."""
        return min(-(-num_tokens // self.block_size), self.max_blocks)

    def table_index(self, logical_block: int) -> int:
        """Where logical block ``logical_block`` lives in the block table."""
        sink_blocks = self.sink_blocks
        if logical_block < sink_blocks:
            return logical_block
        return sink_blocks + (logical_block - sink_blocks) % self.ring_blocks

    def max_chunk(self, start: int) -> int:
        """The most tokens a step may compute from position ``start``: the blocks from the first one the
        chunk's first query reads (past the sinks) through the chunk's last one must be distinct ring slots."""
        if not self.recycles:
            return UNBOUNDED
        first_read = max(self.sink_blocks, (start - self.window + 1) // self.block_size)
        return (first_read + self.ring_blocks) * self.block_size - start

    def kernel_row(self) -> tuple[int, int, int, int]:
        return self.num_sinks, self.window, self.sink_blocks, self.ring_blocks


def check_streaming(window: int, num_sinks: int, block_size: int) -> None:
    """``ValueError`` unless ``streaming_window`` = ``window`` (0: off) and ``streaming_sinks`` = ``num_sinks``
    make a ring of ``block_size``-token blocks."""
    if window < 0 or num_sinks < 0:
        raise ValueError(f"streaming_window and streaming_sinks must be >= 0, got {window} and {num_sinks}")
    if window == 0:
        return
    if window < block_size:
        raise ValueError(f"streaming_window={window} is smaller than one KV block ({block_size} tokens); "
                         f"use at least {block_size}, or 0 to turn streaming off")  # fmt: skip
    if num_sinks >= window:
        raise ValueError(f"streaming_sinks={num_sinks} must be below streaming_window={window}: the sinks are "
                         "kept beside the window, and fewer of them than window tokens")  # fmt: skip


def table_columns(positions: np.ndarray, rings: np.ndarray, block_size: int) -> np.ndarray:
    """Block-table columns ``(tokens,)`` of ``positions (tokens,)`` for sequences whose kernel rows are
    ``rings (tokens, 4)`` (one row per token)."""
    blocks = positions // block_size
    sink_blocks, ring_blocks = rings[:, RING_SINK_BLOCKS], rings[:, RING_BLOCKS]
    return np.where(blocks < sink_blocks, blocks, sink_blocks + (blocks - sink_blocks) % ring_blocks)


def sink_query_positions(positions: np.ndarray, rings: np.ndarray) -> np.ndarray:
    """Where each query sits inside its cache, ``min(t, S + W - 1)``: the position its sink-facing copy is
    rotated at (``positions (tokens,)``, ``rings (tokens, 4)``; equal to ``t`` until the cache is full)."""
    return np.minimum(positions, rings[:, RING_SINKS].astype(np.int64) + rings[:, RING_WINDOW] - 1)
