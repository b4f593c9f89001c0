"""The prefill worker's queue of jobs (``prefill_service.jobs.JobQueue``): taken by priority (lower first), then
arrival."""

from __future__ import annotations

import queue

import pytest

from prefill_service.jobs import JobQueue, PrefillJob


def test_jobs_are_taken_by_priority_then_arrival():
    jobs = JobQueue()
    for name, priority in (("a", 3), ("b", 0), ("c", 3), ("d", -1), ("e", 0)):
        jobs.put_job(PrefillJob(name, [1], None, None, None, priority=priority))
    assert [jobs.get_job().request_id for _ in range(5)] == ["d", "b", "e", "a", "c"]
    with pytest.raises(queue.Empty):
        jobs.get_job(timeout=0.01)
