"""Continuous batching: which sequences run this step, with how many new tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
go first, in the order they were admitted: a decoding sequence takes one
token, a sequence still in its prompt takes the next chunk of it (chunked
prefill). When the pool has no block for a running sequence, the most recently
admitted one is preempted: its blocks are freed and it goes back to the front
of the waiting queue, to be recomputed later, or loaded back when the KV
connector copied its KV out first (swap preemption, ``engine.tier_connector``).

Admission (the scheduler's alone: no caller keeps a queue of its own): waiting
sequences are considered in arrival order while budget and sequence slots
last, and not at all in a step that had to preempt. An admitted sequence first
takes the longest cached prefix the block manager has for its tokens (prefix
caching), then whatever the KV connector can load from outside
(``engine.kv_connector``); those tokens count as computed and cost no budget,
and the chunked-prefill path computes the rest over them. A sequence whose KV
arrives asynchronously (a remote prefill) gets blocks for all its tokens and
waits in ``WAITING_FOR_REMOTE_KV``, in no batch, until the connector reports
the load finished: its blocks count in every later admission and it holds a
sequence slot, but it is never a preemption victim (a writer may be filling its
blocks).

Priorities (``Sequence.priority``, lower first): the waiting queue is ordered by priority, then arrival; a
preempted sequence (or one whose load failed) goes back to the front of its priority. The running sequences
are kept in priority order too (admission order within one): a higher priority's prompt chunks come first out
of each step's budget, and the one preempted for lack of blocks is the lowest priority not yet scheduled, the
latest admitted among equals. Under the ``priority`` policy a waiting sequence that finds no slot or no blocks
also preempts the lowest-priority running sequence below its own (not one admitted in the same step), and a
better prompt's step holds lower priorities back (``priorities.Urgency``). With equal priorities every rule
is the FCFS one. Nothing starves: a waiting sequence is passed by at most ``priorities.MAX_OVERTAKEN`` later
arrivals of a higher priority, and the policy preempts a sequence at most ``MAX_POLICY_PREEMPTIONS`` times.

A sequence whose blocks do not fit does not block the smaller ones behind it:
it is passed over (at most ``LOOKAHEAD`` sequences are passed per step, which
bounds the step's prefix matching), until ``MAX_PASSED_OVER`` admissions have
gone past it; from then on it blocks the queue until it fits, so a large
request waits a bounded number of admissions, never forever. A sequence whose
structured output's grammar is still compiling (``engine.structured_output``)
is passed over the same way, without counting as passed over.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_connector import FinishedLoad, KVConnector
from engine.parallel_sampling import choice_id
from engine.priorities import Urgency, in_prompt, insert_by_priority
from engine.sequence import Sequence, SequenceStatus
from kvstore import Block, BlockManager

LOOKAHEAD = 4  # waiting sequences passed over per step at most
MAX_PASSED_OVER = 16  # admissions that may pass a sequence before it blocks the queue
MAX_POLICY_PREEMPTIONS = 4  # times the priority policy may preempt one sequence


@dataclass
class ScheduledBatch:
    """Decodes (one new token) first, then prefill chunks. ``admitted``: the sequences that left the waiting
    queue this step (their cached and loadable prefix, ``num_computed_tokens`` of them, was just matched)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: KVConnector | None = None, policy: str = "fcfs",
                 priority_chunk_tokens: int = 0) -> None:  # fmt: skip
        self.block_manager = block_manager
        self.policy = policy
        self.urgency = Urgency(policy == "priority", priority_chunk_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector or KVConnector()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._passed_over: dict[str, int] = {}  # seq id -> admissions that went past it while it did not fit

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue ``seq`` last of its priority, or ``first`` (a choice of a request already admitted,
        ``engine.parallel_sampling``)."""
        insert_by_priority(self.waiting, seq, first, bounded=not first)
        if not first:
            self.urgency.arrived(seq.priority)

    def _run(self, seq: Sequence) -> None:
        """Add ``seq`` to the running, last of its priority: each step walks them in this order, so a prompt of a
        higher priority takes its chunks of the token budget before those of a lower one."""
        insert_by_priority(self.running, seq)

    def _requeue(self, seq: Sequence) -> None:
        """Put ``seq`` back first of its priority (preempted, or its load failed)."""
        insert_by_priority(self.waiting, seq, first=True)

    def num_prefilling(self) -> int:
        """Running sequences with more than their last token to compute: prompts (or preempted sequences'
        recomputes) being prefilled here, chunk by chunk."""
        return sum(1 for seq in self.running if in_prompt(seq))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        running = self.running
        self.urgency.begin_step(running, self.waiting)
        if running and len(running) <= budget and not self.urgency.hold_decodes and all(
                s.num_computed_tokens + 1 == s.num_tokens and not s.spec_token_ids for s in running):  # fmt: skip
            # Every running sequence decodes: one batched allocation. If one finds no block, the walk below
            # preempts exactly as it would have (the sequences before it already hold their new block).
            grown, starved = self.block_manager.allocate_decode([s.seq_id for s in running],
                                                                [s.num_tokens for s in running])  # fmt: skip
            for j in grown:
                running[j].block_table = self.block_manager.block_table_array(running[j].seq_id)
            if not starved:
                picked = [(s, 1) for s in running]
                budget -= len(running)
                i = len(running)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.urgency.hold(seq):  # (the priority policy's, for a better prompt)
                i += 1
                continue
            n = self.urgency.chunk(seq, seq.num_computed_tokens, budget)
            if seq.spec_token_ids and not self._allocate(seq, seq.num_computed_tokens + n):
                seq.spec_token_ids.clear()  # no blocks for its proposals: it decodes plainly, preempting no one
                n = seq.num_tokens_to_compute(seq.num_computed_tokens, budget)
            while not self._allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the lowest priority, the latest admitted among equals
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                picked.append((seq, n))
                budget -= n
                i += 1
        admitted = [] if preempted else self._admit(budget, picked)
        self._schedule_held(self.urgency.release([s for s, _ in picked]), picked)
        decodes = [(s, n) for s, n in picked if n == 1]
        prefills = [(s, n) for s, n in picked if n != 1]
        ordered = decodes + prefills
        return ScheduledBatch([s for s, _ in ordered], [n for _, n in ordered], len(decodes), admitted)

    def _admit(self, budget: int, picked: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Admit waiting sequences (see the module's docstring); add the ones that compute to ``picked``."""
        admitted: list[Sequence] = []
        passed: list[Sequence] = []
        while self.waiting and len(passed) < LOOKAHEAD:
            seq = self.waiting[0]
            if not self.urgency.admits(seq, picked):
                break  # (lower priorities wait behind it: the queue is in priority order)
            if self._num_slots_used() >= self.max_num_seqs:
                freed = self._make_room(seq, picked, admitted)
                if freed is None:
                    break
                budget += freed
                continue
            if seq.grammar is not None and not seq.grammar.ready:  # its grammar still compiles: try it later
                passed.append(self.waiting.popleft())
                continue
            cached = self._prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            may_load = _may_load(seq) and (self.connector.brings_logits or not seq.wants_prompt_logprobs)
            num_external, later = self.connector.num_external_tokens(seq, num_cached) if may_load else (0, False)
            num_start = num_cached + num_external
            n = 0 if later else self.urgency.chunk(seq, num_start, budget)
            if not later and n == 0:
                break  # no budget left
            if not self._allocate(seq, seq.num_tokens if later else num_start + n, cached):
                freed = self._make_room(seq, picked, admitted)
                if freed is not None:
                    budget += freed
                    continue  # (matched again: the room may come from its own prefix's blocks)
                if self._passed_over.get(seq.seq_id, 0) >= MAX_PASSED_OVER:
                    break  # it has waited long enough: nothing goes ahead of it any more
                passed.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            for other in passed:
                if other.grammar is None or other.grammar.ready:  # (waiting for a grammar is no passing over)
                    self._passed_over[other.seq_id] = self._passed_over.get(other.seq_id, 0) + 1
            self._passed_over.pop(seq.seq_id, None)
            seq.num_computed_tokens = num_cached if later else num_start
            if seq.num_preemptions == 0:
                seq.num_cached_tokens, seq.num_external_tokens = num_cached, num_external
            if later:
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_kv[seq.seq_id] = seq
            else:
                seq.status = SequenceStatus.RUNNING
                self._run(seq)
                admitted.append(seq)
                picked.append((seq, n))
                budget -= n
            self.connector.after_allocate(seq, num_external)
        self.waiting.extendleft(reversed(passed))
        return admitted

    def _schedule_held(self, held: list[Sequence], picked: list[tuple[Sequence, int]]) -> None:
        """Give the sequences held back this step what the budget has left (none preempts another)."""
        budget = self.max_num_batched_tokens - sum(n for _, n in picked)
        for seq in held:
            n = self.urgency.chunk(seq, seq.num_computed_tokens, budget)
            if seq.status is SequenceStatus.RUNNING and n > 0 and self._allocate(seq, seq.num_computed_tokens + n):
                picked.append((seq, n))
                budget -= n

    def _make_room(self, seq: Sequence, picked: list[tuple[Sequence, int]], admitted: list[Sequence]) -> int | None:
        """Under the ``priority`` policy: preempt the lowest-priority running sequence whose priority is below
        ``seq``'s (the latest admitted among equals; not one admitted this step) and take it out of this step's
        batch; the budget it had, or None when the policy is FCFS or there is none."""
        if self.policy != "priority":
            return None
        lower = [j for j, s in enumerate(self.running) if s.priority > seq.priority and s not in admitted
                 and s.num_preemptions < MAX_POLICY_PREEMPTIONS]  # fmt: skip
        if not lower:
            return None
        victim = self.running.pop(max(lower, key=lambda j: (self.running[j].priority, j)))
        freed = sum(n for s, n in picked if s is victim)
        picked[:] = [(s, n) for s, n in picked if s is not victim]
        self._preempt(victim)
        return freed

    def _prefix(self, seq: Sequence) -> list[Block]:
        """The blocks ``seq`` starts with, their KV computed: a later choice of a request shares its choice 0's
        prompt blocks (``engine.parallel_sampling``) or the prefix cache's hit, the longer. None of them for a sequence
        whose prompt log-probabilities are wanted: a cache holds no logits, so it computes its positions."""
        if seq.wants_prompt_logprobs:
            return []
        hit = self.block_manager.match_prefix(seq.token_ids, seq.ring)
        if seq.index == 0:
            return hit
        shared = self.block_manager.shared_prefix(choice_id(seq.request_id, 0), seq.num_prompt_tokens - 1)
        return shared if len(shared) > len(hit) else hit

    def _num_slots_used(self) -> int:
        return len(self.running) + len(self.waiting_for_kv)

    def finish_loads(self, loads: list[FinishedLoad]) -> list[tuple[Sequence, FinishedLoad]]:
        """Apply finished asynchronous loads: a loaded sequence runs (all its tokens computed); one whose load
        failed goes back to the front of the waiting queue. Returns (loaded sequence, its load)."""
        loaded = []
        for load in loads:
            seq = self.waiting_for_kv.pop(load.seq_id, None)
            if seq is None:  # ended meanwhile
                continue
            if load.first_token is None:
                self._free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
                self._requeue(seq)
            else:
                seq.num_computed_tokens = seq.num_tokens
                seq.status = SequenceStatus.RUNNING
                self._run(seq)
                loaded.append((seq, load))
        return loaded

    def _allocate(self, seq: Sequence, num_tokens: int, cached: list[Block] | None = None) -> bool:
        if not self.block_manager.allocate(seq.seq_id, num_tokens, cached or (), seq.ring):
            return False
        seq.block_table = self.block_manager.block_table_array(seq.seq_id)  # O(1): a view, not a copy
        return True

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.block_table = self.block_manager.block_table_array(seq.seq_id)  # empty now

    def _preempt(self, seq: Sequence) -> None:
        self.connector.preempt(seq)  # its KV is still in its blocks: a swap copies it out now
        self._free(seq)
        seq.spec_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._requeue(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of whichever queue holds it and free its blocks (unless the connector keeps them)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[seq.seq_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._passed_over.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not self.connector.request_finished(seq):
            self._free(seq)


def _may_load(seq: Sequence) -> bool:
    """Whether the KV connector may load ``seq``'s KV: connectors fill blocks by their place in the sequence,
    which a ring that wraps (``kvstore.ring``) does not keep, so such a sequence computes its own. (One that
    still needs its prompt's logits loads only from a connector that ``brings_logits``.)"""
    return seq.ring is None or seq.num_tokens <= seq.ring.num_exact_tokens
