"""The prefill worker's KV connector: each prompt's KV goes into blocks of a decode worker's pool.

A request's ``kv_params`` is a ``Handoff``: the decode worker's pool (mapped in place: ``shm`` or
``cuda_ipc``; a ``SplitPool``, whose parts may split the heads over ranks otherwise than ours do; None for
``grpc``, whose blocks the worker reads out of our own pool after the prompt is done) and the decode
worker's block table for the prompt from position 0. That pool already holds
the first ``num_held_tokens`` (whole blocks): those blocks are only ever read, for other sequences there may
be using them. Everything after them must end up there.

* Load (``start_loads``): with ``readable``, the held blocks beyond our own cached prefix are copied into our
  fresh blocks before the step, so attention reads them from our pool and our prefix cache keeps them;
  admission counts them as computed (``num_external_tokens``).
* Save (``save``): after each step the blocks the step touched (and, on the first step, our own cached
  blocks the destination lacks) are copied to the destination's blocks, whole blocks, layer by layer.

The right to touch the destination ends at ``deadline`` (``time.monotonic()``, the lease's write deadline):
every copy checks it before each layer, so a copy under way then stops within one layer. A sequence found
past it after a step, or whose load stopped short, is reported by ``save``; the engine ends it without
caching that step's blocks, so what was read from the destination is cached only when the read finished
inside the right. A hand-off keeps its blocks after it ends (``request_finished``) until the worker releases
them (a ``grpc`` hand-off has no pool to write: it only keeps the blocks, which the transport reads out).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_connector import KVConnector
from engine.sequence import Sequence
from kvstore.kv_cache import KVCache
from kvstore.split_pool import SplitPool, copy_blocks


@dataclass(eq=False)
class Handoff:
    """Where one prompt's KV goes; see the module's docstring."""

    pool: SplitPool | KVCache | None
    block_table: list[int]
    block_size: int
    num_held_tokens: int = 0
    readable: bool = False
    deadline: float | None = None
    num_saved_blocks: int = field(init=False)  # blocks below this are in the destination already
    read: tuple[int, int] | None = field(default=None, init=False)  # held blocks to copy in before the step
    failed: bool = field(default=False, init=False)  # a load stopped short at the deadline

    def __post_init__(self) -> None:
        if self.pool is not None:
            self.pool = SplitPool.of(self.pool)  # (an unsplit KVCache is one part)
        if self.num_held_tokens % self.block_size or self.num_held_tokens < 0:
            raise ValueError(f"num_held_tokens={self.num_held_tokens} must be whole blocks of {self.block_size}")
        if self.readable and not self.num_held_tokens:
            raise ValueError("a readable destination prefix needs num_held_tokens")
        self.num_saved_blocks = self.num_held_tokens // self.block_size

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


class HandoffConnector(KVConnector):
    def __init__(self, own: SplitPool | KVCache, block_size: int) -> None:
        self.own = SplitPool.of(own)
        self.block_size = block_size

    def num_external_tokens(self, seq: Sequence, num_cached_tokens: int) -> tuple[int, bool]:
        handoff: Handoff | None = seq.kv_params
        if handoff is None or not handoff.readable or handoff.num_held_tokens <= num_cached_tokens:
            return 0, False
        return handoff.num_held_tokens - num_cached_tokens, False

    def after_allocate(self, seq: Sequence, num_external_tokens: int) -> None:
        handoff: Handoff | None = seq.kv_params
        if handoff is None:
            return
        # (again) after a preemption: what is recomputed now is what the first token comes from: save it all
        handoff.num_saved_blocks = handoff.num_held_tokens // self.block_size
        if num_external_tokens:
            end = seq.num_computed_tokens // self.block_size
            handoff.read = (end - num_external_tokens // self.block_size, end)

    def start_loads(self, admitted: list[Sequence]) -> None:
        for seq in admitted:
            handoff: Handoff | None = seq.kv_params
            if handoff is None or handoff.read is None:
                continue
            first, end = handoff.read
            handoff.read = None
            src, dst = handoff.block_table[first:end], seq.block_table[first:end].tolist()
            if not copy_blocks(handoff.pool, src, self.own, dst, handoff.deadline):
                handoff.failed = True

    def save(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[Sequence]:
        failed = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            handoff: Handoff | None = seq.kv_params
            if handoff is None or handoff.pool is None:
                continue
            computed = seq.num_computed_tokens + n
            first, end = handoff.num_saved_blocks, -(-computed // self.block_size)
            if handoff.failed or handoff.expired():
                failed.append(seq)
                continue
            if end > first:
                src, dst = seq.block_table[first:end].tolist(), handoff.block_table[first:end]
                if not copy_blocks(self.own, src, handoff.pool, dst, handoff.deadline):
                    failed.append(seq)
                    continue
            handoff.num_saved_blocks = computed // self.block_size
            if handoff.expired():  # the copy may have finished after the right ran out
                failed.append(seq)
        return failed

    def request_finished(self, seq: Sequence) -> bool:
        # a hand-off's blocks stay until the worker has answered (``grpc`` reads them out first) and releases them
        return isinstance(seq.kv_params, Handoff)
