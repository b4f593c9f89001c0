"""``engine.Scheduler`` on its own: which sequences a step runs, in which order and with how many tokens; which
sequence is preempted when blocks run out; no admission in a step that preempted; who may pass a sequence that
does not fit; sequences waiting for remote KV. Blocks of 4 tokens."""

from __future__ import annotations

from engine.kv_connector import FinishedLoad, KVConnector
from engine.priorities import MAX_OVERTAKEN
from engine.sampling_params import SamplingParams
from engine.scheduler import MAX_PASSED_OVER, MAX_POLICY_PREEMPTIONS, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import IncrementalDetokenizer
from kvstore import BlockManager

BLOCK = 4


def _seq(name: str, num_tokens: int) -> Sequence:
    ids = list(range(1, num_tokens + 1))
    return Sequence(seq_id=name, prompt_token_ids=ids, params=SamplingParams(),
                    detokenizer=IncrementalDetokenizer(None, ids))  # fmt: skip


def _scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, budget)


def _run(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and pretend it ran: every scheduled token is computed, and a sequence that finished
    its prompt samples one token."""
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


def test_decodes_run_before_prefill_chunks_and_waiting_sequences_join_in_arrival_order():
    scheduler = _scheduler(num_blocks=32, budget=10)
    a, b, c = _seq("a", 6), _seq("b", 3), _seq("c", 8)
    for seq in (a, b, c):
        scheduler.add(seq)
    # a and b fit whole (6 + 3), c gets the last token of the budget as its first chunk; a one-token chunk
    # goes with the decodes (one query token over the cache is what the decode path computes)
    assert _run(scheduler) == [("c", 1), ("a", 6), ("b", 3)]
    assert [s.seq_id for s in scheduler.running] == ["a", "b", "c"]
    # now a and b decode (one token each), c takes the rest of its prompt; decodes come first in the batch
    assert _run(scheduler) == [("a", 1), ("b", 1), ("c", 7)]
    assert _run(scheduler) == [("a", 1), ("b", 1), ("c", 1)]


def test_the_token_budget_chunks_a_long_prompt():
    scheduler = _scheduler(num_blocks=32, budget=5)
    scheduler.add(_seq("long", 12))
    assert [_run(scheduler) for _ in range(4)] == [[("long", 5)], [("long", 5)], [("long", 2)], [("long", 1)]]


def test_the_most_recently_admitted_sequence_is_preempted_and_nobody_is_admitted_that_step():
    # 6 blocks: a (8 tokens = 2 blocks) and b (8 tokens = 2 blocks) fit with 2 blocks to spare
    scheduler = _scheduler(num_blocks=6, budget=64)
    a, b = _seq("a", 8), _seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    assert _run(scheduler) == [("a", 8), ("b", 8)]
    # each now needs a third block for its 9th token's KV: 2 spare blocks, so both decode
    assert _run(scheduler) == [("a", 1), ("b", 1)]
    waiting = _seq("w", 2)
    scheduler.add(waiting)
    for _ in range(3):  # tokens 10-12 fit in the third blocks
        _run(scheduler)
    # the 13th token needs a fourth block each: only a gets one; b (admitted last) is preempted, and the waiting
    # sequence is not admitted in this step even though b's freed blocks would hold it
    assert _run(scheduler) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(scheduler.waiting) == [b, waiting]  # the victim goes back to the front
    assert scheduler.num_preemptions == 1
    assert len(b.token_ids) == 8 + 5  # its output is kept: it is recomputed, not restarted


def test_a_sequence_that_does_not_fit_lets_smaller_ones_pass_until_it_has_waited_long_enough():
    scheduler = _scheduler(num_blocks=3, budget=64)
    big, small = _seq("big", 16), _seq("small", 2)  # big needs 4 blocks of the 3: it can never fit here
    scheduler.add(big)
    scheduler.add(small)
    assert _run(scheduler) == [("small", 2)]  # small goes ahead of big
    assert list(scheduler.waiting) == [big]
    scheduler.finish(small, "stop")
    for i in range(MAX_PASSED_OVER - 1):  # more small ones keep passing it ...
        scheduler.add(passer := _seq(f"s{i}", 2))
        assert _run(scheduler) == [(f"s{i}", 2)]
        scheduler.finish(passer, "stop")
    scheduler.add(_seq("late", 2))  # ... until it has been passed MAX_PASSED_OVER times: now it blocks the queue
    assert _run(scheduler) == []
    assert [s.seq_id for s in scheduler.waiting] == ["big", "late"]


class _RemoteLoads(KVConnector):
    """Sequences whose ``kv_params`` is "remote" load every token after their cached prefix asynchronously;
    the test finishes the loads."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.done: list[FinishedLoad] = []

    def num_external_tokens(self, seq, num_cached_tokens):
        return (seq.num_tokens - num_cached_tokens, True) if seq.kv_params == "remote" else (0, False)

    def after_allocate(self, seq, num_external_tokens):
        if num_external_tokens:
            self.started.append(seq.seq_id)

    def finished_loads(self):
        done, self.done = self.done, []
        return done


def _remote_scheduler(num_blocks: int, max_num_seqs: int = 8) -> tuple[Scheduler, _RemoteLoads]:
    connector = _RemoteLoads()
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, 64, connector), connector


def test_a_remote_load_holds_its_blocks_in_no_batch_and_runs_with_its_first_token_once_loaded():
    scheduler, loads = _remote_scheduler(num_blocks=8)
    remote, local = _seq("remote", 8), _seq("local", 8)
    remote.kv_params = "remote"
    scheduler.add(remote)
    scheduler.add(local)
    assert _run(scheduler) == [("local", 8)]  # the remote one computes nothing here
    assert loads.started == ["remote"] and remote.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.block_manager.num_free_blocks == 8 - 2 - 2  # its blocks are allocated and counted
    loads.done.append(FinishedLoad("remote", 42))
    assert scheduler.finish_loads(loads.finished_loads()) == [(remote, FinishedLoad("remote", 42))]
    assert remote.status is SequenceStatus.RUNNING and remote.num_computed_tokens == 8
    remote.token_ids.append(42)  # the engine appends the loader's token
    assert _run(scheduler) == [("local", 1), ("remote", 1)]


def test_a_failed_load_frees_its_blocks_and_goes_back_to_the_front_of_the_queue():
    scheduler, loads = _remote_scheduler(num_blocks=8)
    remote, other = _seq("remote", 8), _seq("other", 12)
    remote.kv_params = "remote"
    scheduler.add(remote)
    _run(scheduler)
    scheduler.add(other)  # 3 blocks: fits beside remote's 2 ...
    scheduler.finish_loads([FinishedLoad("remote", None)])
    assert remote.status is SequenceStatus.WAITING and scheduler.block_manager.num_free_blocks == 8
    assert list(scheduler.waiting) == [remote, other]  # ... and remote is admitted again first
    _run(scheduler)
    assert loads.started == ["remote", "remote"]


def test_remote_loads_take_sequence_slots_and_are_never_preempted():
    scheduler, _ = _remote_scheduler(num_blocks=3, max_num_seqs=2)
    remote, a, b = _seq("remote", 4), _seq("a", 4), _seq("b", 4)
    remote.kv_params = "remote"
    for seq in (remote, a, b):
        scheduler.add(seq)
    assert _run(scheduler) == [("a", 4)]  # remote + a fill the 2 slots: b waits
    assert [s.seq_id for s in scheduler.waiting] == ["b"]
    for _ in range(5):  # a decodes into its second block, then needs a third ...
        _run(scheduler)
    # ... which does not exist (remote holds 1, a 2): a is preempted, never the remote load
    assert remote.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert a.num_preemptions == 1 and "remote" in scheduler.waiting_for_kv


def test_max_num_seqs_caps_the_running_batch():
    scheduler = _scheduler(num_blocks=32, max_num_seqs=2)
    for name in "abc":
        scheduler.add(_seq(name, 2))
    assert [name for name, _ in _run(scheduler)] == ["a", "b"]
    assert [s.seq_id for s in scheduler.waiting] == ["c"]


def test_a_finished_sequence_frees_its_blocks():
    scheduler = _scheduler(num_blocks=4)
    a = _seq("a", 8)
    scheduler.add(a)
    _run(scheduler)
    assert scheduler.block_manager.num_free_blocks == 2  # the prompt's 8 tokens of KV: 2 blocks
    scheduler.finish(a, "stop")
    assert scheduler.block_manager.num_free_blocks == 4
    assert a.status is SequenceStatus.FINISHED and not scheduler.has_unfinished()


def _prioritized(name: str, num_tokens: int, priority: int) -> Sequence:
    seq = _seq(name, num_tokens)
    seq.priority = priority
    return seq


def test_waiting_sequences_are_taken_by_priority_then_arrival_and_the_preempted_go_first_of_their_priority():
    scheduler = _scheduler(num_blocks=32, max_num_seqs=1)
    seqs = {name: _prioritized(name, 4, p) for name, p in (("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0))}
    for seq in seqs.values():
        scheduler.add(seq)
    assert [s.seq_id for s in scheduler.waiting] == ["d", "b", "e", "a", "c"]
    scheduler._requeue(_prioritized("p", 4, 0))  # a preempted sequence: before b and e, after d
    scheduler.add(_prioritized("f", 4, 5))
    assert [s.seq_id for s in scheduler.waiting] == ["d", "p", "b", "e", "a", "c", "f"]
    assert _run(scheduler) == [("d", 4)]


def test_running_sequences_keep_priority_order_and_the_lowest_is_preempted_out_of_blocks():
    """Admitted a, then b (priority 9), then c (priority 1), they run as a, c, b: c's prompt chunks would come
    before b's. The pool full, b's 5th token needs a block: b, the last (the lowest priority), is preempted, where
    admission order alone would have put c last and taken it."""
    scheduler = _scheduler(num_blocks=5, budget=64)
    a, b, c = _prioritized("a", 8, 0), _prioritized("b", 3, 9), _prioritized("c", 3, 1)
    scheduler.add(a)
    assert _run(scheduler) == [("a", 8)]
    scheduler.add(b)
    assert _run(scheduler) == [("a", 1), ("b", 3)]
    scheduler.add(c)
    assert _run(scheduler) == [("a", 1), ("b", 1), ("c", 3)]
    assert [s.seq_id for s in scheduler.running] == ["a", "c", "b"] and scheduler.block_manager.num_free_blocks == 0
    assert _run(scheduler) == [("a", 1), ("c", 1)]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1 and c.num_preemptions == 0


def test_the_priority_policy_preempts_a_lower_priority_running_sequence_for_a_waiting_one():
    """One slot: under ``priority`` a waiting sequence of a higher priority takes it from the running one,
    which goes back first of its priority and is recomputed later; under ``fcfs`` it waits. A sequence of the
    same priority never preempts."""
    for policy, expected in (("priority", [("urgent", 4)]), ("fcfs", [("low", 1)])):
        scheduler = Scheduler(BlockManager(32, BLOCK), 1, 64, policy=policy)
        low = _prioritized("low", 6, 3)
        scheduler.add(low)
        assert _run(scheduler) == [("low", 6)]
        urgent = _prioritized("urgent", 4, 1)
        scheduler.add(urgent)
        assert _run(scheduler) == expected, policy
        if policy == "priority":
            assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1 and not low.block_table.size
            assert list(scheduler.waiting) == [low] and scheduler.running == [urgent]
            peer = _prioritized("peer", 4, 1)
            scheduler.add(peer)
            assert _run(scheduler) == [("urgent", 1)]  # the same priority waits for the slot
            assert list(scheduler.waiting) == [peer, low]


def test_a_low_priority_sequence_is_passed_by_a_bounded_number_of_later_higher_ones():
    """Starvation bound: MAX_OVERTAKEN later arrivals of a higher priority go ahead of a waiting sequence; the
    ones after them queue behind it (still by priority among themselves)."""
    scheduler = _scheduler(num_blocks=32, max_num_seqs=1)
    scheduler.add(_prioritized("low", 4, 9))
    for i in range(MAX_OVERTAKEN + 3):
        scheduler.add(_prioritized(f"h{i}", 4, i % 2))  # priorities 0 and 1, alternating
    order = [s.seq_id for s in scheduler.waiting]
    assert order.index("low") == MAX_OVERTAKEN
    assert order[MAX_OVERTAKEN + 1 :] == [f"h{MAX_OVERTAKEN}", f"h{MAX_OVERTAKEN + 2}", f"h{MAX_OVERTAKEN + 1}"]
    # (without a cap all of them would be ahead: "low" last)


def test_the_priority_policy_preempts_one_sequence_a_bounded_number_of_times():
    scheduler = Scheduler(BlockManager(32, BLOCK), 1, 64, policy="priority")
    low = _prioritized("low", 6, 3)
    scheduler.add(low)
    assert _run(scheduler) == [("low", 6)]
    for i in range(MAX_POLICY_PREEMPTIONS + 1):
        urgent = _prioritized(f"u{i}", 4, 1)
        scheduler.add(urgent)
        _run(scheduler)
        if scheduler.running[0] is urgent:  # it took the slot: it ends, and low runs again
            scheduler.finish(urgent, "length")
            _run(scheduler)
    assert low.num_preemptions == MAX_POLICY_PREEMPTIONS and low.status is SequenceStatus.RUNNING
