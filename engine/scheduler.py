"""Continuous batching: which sequences run this step, with how many new tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
go first, in the order they were admitted: a decoding sequence takes one
token, a sequence still in its prompt takes the next chunk of it (chunked
prefill). When the pool has no block for a running sequence, the most recently
admitted one is preempted: its blocks are freed and it goes back to the front
of the waiting queue, to be recomputed later. Waiting sequences are admitted
in arrival order while budget, sequence slots and blocks last, and not at all
in a step that had to preempt. An admitted sequence first takes the longest
cached prefix the block manager has for its tokens (prefix caching): those
tokens count as computed and cost no budget, and the chunked-prefill path
computes the rest over them. A sequence prefilled for another worker whose
destination lets it read a longer prefix counts that one as computed instead
(the engine copies it in before the step runs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Sequence, SequenceStatus
from kvstore import Block, BlockManager


@dataclass
class ScheduledBatch:
    """Decodes (one new token) first, then prefill chunks. ``admitted``: the sequences that left the waiting
    queue this step (their cached prefix, ``num_computed_tokens`` of them, was just matched)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is already in its blocks joins the running batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        admitted: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                picked.append((seq, n))
                budget -= n
                i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.match_prefix(seq.token_ids)
            num_cached = len(cached) * self.block_manager.block_size
            # a prefix the destination holds and lets us read is copied in by the engine (fresh blocks past
            # our cached ones), so it costs no budget either
            num_start = max(num_cached, seq.num_dest_readable_tokens)
            n = min(seq.num_tokens - num_start, budget)
            if not self._allocate(seq, num_start + n, cached):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_start
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                seq.num_dest_read_tokens = num_start - num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            picked.append((seq, n))
            budget -= n
        decodes = [(s, n) for s, n in picked if n == 1]
        prefills = [(s, n) for s, n in picked if n != 1]
        ordered = decodes + prefills
        return ScheduledBatch([s for s, _ in ordered], [n for _, n in ordered], len(decodes), admitted)

    def _allocate(self, seq: Sequence, num_tokens: int, cached: list[Block] | None = None) -> bool:
        if not self.block_manager.allocate(seq.seq_id, num_tokens, cached or ()):
            return False
        seq.block_table = self.block_manager.block_table_array(seq.seq_id)  # O(1): a view, not a copy
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.block_table = self.block_manager.block_table_array(seq.seq_id)  # empty now
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.hold_blocks:
            self.block_manager.free(seq.seq_id)
            seq.block_table = self.block_manager.block_table_array(seq.seq_id)  # empty now
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
