"""The ``priority`` policy keeps an urgent prompt's steps short (``engine.scheduler``, ``engine.priorities.Urgency``):
a step that prefills a better priority's prompt runs nothing of lower priorities (their decodes sit out at most
one step in two), unless the better prompt gets no chunk; after an arrival of the best priority, lower
priorities' prompts take at most ``priority_chunk_tokens`` of a step together, for ``URGENT_FOR_S``. Under
``fcfs`` neither applies. Blocks of 4."""

from __future__ import annotations

from test_scheduler import _prioritized, _run

from engine.priorities import URGENT_FOR_S
from engine.scheduler import MAX_POLICY_PREEMPTIONS, Scheduler
from kvstore import BlockManager

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(policy: str, budget: int, chunk: int = 0, max_num_seqs: int = 8) -> tuple[Scheduler, Clock]:
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs, budget, policy=policy, priority_chunk_tokens=chunk)
    clock = scheduler.urgency._clock = Clock()
    return scheduler, clock


def test_an_urgent_prompt_runs_without_lower_prompt_chunks_beside_it():
    for policy in ("priority", "fcfs"):
        scheduler, _ = _scheduler(policy, budget=20)
        scheduler.add(_prioritized("dec", 3, 5))
        scheduler.add(_prioritized("low", 40, 5))
        assert _run(scheduler) == [("dec", 3), ("low", 17)]
        scheduler.add(_prioritized("urgent", 8, 0))
        if policy == "priority":  # low's prompt and dec's decode sit out this step
            assert _run(scheduler) == [("urgent", 8)]
            assert _run(scheduler) == [("urgent", 1), ("dec", 1), ("low", 18)]  # (running by priority)
        else:  # the running prompt's chunk first, out of the same budget
            assert _run(scheduler) == [("dec", 1), ("low", 19)]


def test_an_urgent_prompt_admitted_beside_free_slots_admits_no_lower_prompt_with_it():
    """Slots and budget for all: the urgent prompt is admitted alone, the lower one waiting behind it starts the
    step after (where a flood's requests end together, their successors were prefilled beside the urgent one)."""
    for policy in ("priority", "fcfs"):
        scheduler, _ = _scheduler(policy, budget=64)
        scheduler.add(_prioritized("low", 20, 5))
        scheduler.add(_prioritized("urgent", 8, 0))  # (queued ahead of low under either policy's order)
        if policy == "priority":
            assert _run(scheduler) == [("urgent", 8)]
            assert _run(scheduler) == [("urgent", 1), ("low", 20)]
        else:
            assert _run(scheduler) == [("urgent", 8), ("low", 20)]


def test_a_held_prompt_runs_when_the_better_one_gets_no_chunk():
    """Two slots, both taken; the urgent prompt may preempt neither (its peer is of its priority, and low has
    been preempted as often as the policy allows): low's prompt goes on rather than wait for nothing."""
    scheduler, _ = _scheduler("priority", budget=20, max_num_seqs=2)
    peer, low = _prioritized("peer", 3, 0), _prioritized("low", 40, 5)
    low.num_preemptions = MAX_POLICY_PREEMPTIONS
    scheduler.add(peer)
    assert _run(scheduler) == [("peer", 3)]
    scheduler.add(low)
    assert _run(scheduler) == [("peer", 1), ("low", 19)]
    scheduler.add(_prioritized("urgent", 8, 0))
    assert _run(scheduler) == [("peer", 1), ("low", 19)]
    assert [s.seq_id for s in scheduler.waiting] == ["urgent"]


def test_after_an_urgent_arrival_lower_prompts_share_a_small_chunk_of_each_step_for_a_while():
    scheduler, clock = _scheduler("priority", budget=64, chunk=8)
    scheduler.add(_prioritized("a", 30, 5))  # no urgent arrival yet: the best so far is 5, nothing is capped
    assert _run(scheduler) == [("a", 30)]
    urgent = _prioritized("urgent", 6, 0)
    scheduler.add(urgent)
    assert _run(scheduler) == [("urgent", 6)]
    scheduler.finish(urgent, "length")
    scheduler.add(_prioritized("b", 30, 5))
    scheduler.add(_prioritized("c", 30, 5))
    steps = [_run(scheduler) for _ in range(3)]
    assert steps == [[("a", 1), ("b", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 8)]]  # 8 a step, b's first
    clock.now += URGENT_FOR_S + 1  # the urgent request is long gone: whole steps again
    assert _run(scheduler) == [("a", 1), ("b", 6), ("c", 30)]


def test_lower_decodes_sit_out_at_most_one_step_in_two_under_a_stream_of_urgent_prompts():
    scheduler, _ = _scheduler("priority", budget=64)
    scheduler.add(_prioritized("dec", 3, 5))
    _run(scheduler)
    ran = []
    for i in range(6):
        scheduler.add(_prioritized(f"u{i}", 4, 0))  # a new urgent prompt before every step
        ran.append(any(name == "dec" for name, _ in _run(scheduler)))
    assert ran == [False, True] * 3


def test_without_a_cap_or_under_fcfs_lower_prompts_take_the_whole_budget():
    for policy, chunk in (("priority", 0), ("fcfs", 8)):
        scheduler, _ = _scheduler(policy, budget=64, chunk=chunk)
        urgent = _prioritized("urgent", 6, 0)
        scheduler.add(urgent)
        _run(scheduler)
        scheduler.finish(urgent, "length")
        scheduler.add(_prioritized("low", 30, 5))
        assert _run(scheduler) == [("low", 30)], (policy, chunk)
