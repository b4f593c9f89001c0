"""Prefill for another worker's pool (the destination): which prompt positions move which way, and when.

A sequence with a ``kv_destination`` = (the destination pool's layers, its block table for the prompt) must
leave the KV of positions ``num_dest_cached_tokens..`` there; the destination already holds the positions
before that. The model runner mirrors every position it computes into the destination as it stores it
(``input_batch``). What admission counted as computed without computing it moves here, once per admission,
before the step runs:

* our own cached prefix beyond what the destination holds is copied out to it;
* with ``read_dest_prefix``, the destination's prefix beyond our own cached one is copied in to our fresh
  blocks, so attention reads it from our pool and our prefix cache keeps it (those blocks count as computed).

The destination's blocks below ``num_dest_cached_tokens`` are only ever read: other sequences there may be
using them.

The right to touch the destination ends at ``seq.dest_deadline`` (a lease's): every copy here and every
layer's store in a step checks it first (``KVMirror``), so a step under way at the deadline stops reading and
writing there within one layer. A sequence found past its deadline after a step (``dest_expired``) ends
without caching that step's blocks: blocks read from the destination are cached only when the read is
confirmed to have finished inside the right (and the lease names their tokens, ``rpc.lease``).
"""

from __future__ import annotations

import time

from engine.sequence import Sequence
from kvstore.kv_cache import LayerKV, copy_blocks


def check_destination(kv_destination: tuple[list, list[int]] | None, num_dest_cached_tokens: int,
                      read_dest_prefix: bool, num_tokens: int, block_size: int) -> None:  # fmt: skip
    """Raise ``ValueError`` unless ``num_dest_cached_tokens`` (0, or whole blocks below ``num_tokens`` with a
    destination) and ``read_dest_prefix`` (only with such a prefix, whose blocks the table names) fit."""
    if num_dest_cached_tokens and (
        kv_destination is None or num_dest_cached_tokens % block_size or not 0 < num_dest_cached_tokens < num_tokens
    ):
        raise ValueError(
            f"num_dest_cached_tokens={num_dest_cached_tokens} needs a kv_destination and must be a multiple "
            f"of the block size ({block_size}) below the prompt's {num_tokens} tokens"
        )
    if read_dest_prefix and not num_dest_cached_tokens:
        raise ValueError("read_dest_prefix needs num_dest_cached_tokens: a prefix the destination holds")


def exchange_prefix(seq: Sequence, own: list[LayerKV], num_own_cached_tokens: int, block_size: int) -> None:
    """Right after ``seq`` was admitted (its ``num_computed_tokens`` is where its computation starts, and
    ``num_own_cached_tokens`` of them came from our prefix cache): copy in the destination's prefix blocks
    that count as computed but are not ours, and copy out our cached blocks that the destination lacks.
    Either copy stops, layer by layer, at ``seq.dest_deadline``: the step then ends ``seq`` (``dest_expired``)."""
    layers, dst_blocks = seq.kv_destination
    own_end, dest_end = num_own_cached_tokens // block_size, seq.num_dest_cached_tokens // block_size
    computed_end = seq.num_computed_tokens // block_size
    until = seq.dest_deadline
    if seq.read_dest_prefix and dest_end > own_end:  # then computed_end == dest_end: nothing goes out
        src, dst = dst_blocks[own_end:dest_end], seq.block_table[own_end:dest_end].tolist()
        if not copy_blocks(layers, src, own, dst, until):
            return
    if computed_end > dest_end:
        src, dst = seq.block_table[dest_end:computed_end].tolist(), dst_blocks[dest_end:computed_end]
        copy_blocks(own, src, layers, dst, until)


def dest_expired(seq: Sequence) -> bool:
    """Whether ``seq``'s right to read and write its destination has run out (so a step may have stopped
    short there, and what it read from there is unconfirmed)."""
    return seq.dest_deadline is not None and time.monotonic() >= seq.dest_deadline
