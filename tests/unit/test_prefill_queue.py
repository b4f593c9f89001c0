"""The prefill worker's queue of jobs (``prefill_service.jobs.JobQueue``): taken by priority (lower first), then
arrival, and a job is passed by a bounded number of later, higher-priority ones."""

from __future__ import annotations

import queue

import pytest

from engine.priorities import MAX_OVERTAKEN
from prefill_service.jobs import JobQueue, PrefillJob


def test_jobs_are_taken_by_priority_then_arrival():
    jobs = JobQueue()
    for name, priority in (("a", 3), ("b", 0), ("c", 3), ("d", -1), ("e", 0)):
        jobs.put_job(PrefillJob(name, [1], None, None, None, priority=priority))
    assert [jobs.get_job().request_id for _ in range(5)] == ["d", "b", "e", "a", "c"]
    with pytest.raises(queue.Empty):
        jobs.get_job(timeout=0.01)


def test_a_low_priority_job_is_passed_by_a_bounded_number_of_later_higher_ones():
    jobs = JobQueue()
    jobs.put_job(PrefillJob("low", [1], None, None, None, priority=9))
    for i in range(MAX_OVERTAKEN + 2):
        jobs.put_job(PrefillJob(f"h{i}", [1], None, None, None, priority=0))
    order = [jobs.get_job().request_id for _ in range(MAX_OVERTAKEN + 3)]
    assert order.index("low") == MAX_OVERTAKEN  # (a heap by priority would take it last)
    assert order[MAX_OVERTAKEN + 1 :] == [f"h{MAX_OVERTAKEN}", f"h{MAX_OVERTAKEN + 1}"]
