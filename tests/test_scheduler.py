"""``engine.Scheduler`` on its own: which sequences a step runs, in which order and with how many tokens; which
sequence is preempted when blocks run out; no admission in a step that preempted. Blocks of 4 tokens."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
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


def test_admission_stops_at_the_first_waiting_sequence_that_does_not_fit():
    scheduler = _scheduler(num_blocks=3, budget=64)
    big, small = _seq("big", 16), _seq("small", 2)  # big needs 4 blocks of the 3
    scheduler.add(big)
    scheduler.add(small)
    assert _run(scheduler) == []  # arrival order: small waits behind big
    assert list(scheduler.waiting) == [big, small]


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
