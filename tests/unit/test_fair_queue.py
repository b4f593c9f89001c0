"""``router.fair_queue.FairQueue``: under contention tenants get slots in proportion to their weights, a tenant
that starts waiting banks no credit from its idle spell, a tenant's own requests go by priority, a waiter
that is cancelled gives its place (or its slot) on, and a tenant below its share is sent on at once, its
requests ranked ahead of those past their tenant's share in the workers' priority."""

from __future__ import annotations

import asyncio

import pytest

from engine.priorities import PRIORITY_RANGE
from router.fair_queue import FairQueue, Hold


async def _served_order(queue: FairQueue, requests: list[tuple[str, float, int]], holder: str) -> list[str]:
    """Queue ``requests`` (tenant, weight, priority) behind a full queue (its one slot ``holder``'s), then free
    one slot at a time: the order in which they got slots."""
    order, holders = [], [holder]

    async def one(tenant: str, weight: float, priority: int) -> None:
        await queue.acquire(tenant, weight, priority)
        order.append(f"{tenant}{priority}" if priority else tenant)
        holders.append(tenant)

    tasks = [asyncio.create_task(one(*request)) for request in requests]
    await asyncio.sleep(0)
    for _ in requests:
        queue.release(holders.pop(0))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_slots_are_shared_by_weight_under_contention():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        await queue.acquire("flood", 1.0)  # the one slot, taken
        requests = [("flood", 1.0, 0)] * 12 + [("b", 2.0, 0)] * 6
        return await _served_order(queue, requests, "flood")

    order = asyncio.run(run())
    # b (weight 2) gets two slots for each of flood's until its 6 are served, though flood queued 12 first
    assert order[:9].count("b") == 6 and order[9:] == ["flood"] * 9


def test_an_idle_tenant_banks_no_credit():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        for _ in range(20):  # a tenant alone: served at once, 20 times
            await queue.acquire("a", 1.0)
            queue.release("a")
        await queue.acquire("a", 1.0)
        # b was idle through a's 20: it starts level with a, not 20 requests ahead
        return await _served_order(queue, [("b", 1.0, 0)] * 4 + [("a", 1.0, 0)] * 4, "a")

    order = asyncio.run(run())
    assert order[:2] in (["a", "b"], ["b", "a"]) and order[:4].count("b") == 2


def test_a_tenants_requests_go_by_priority_then_arrival():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        await queue.acquire("a", 1.0)
        return await _served_order(queue, [("a", 1.0, 5), ("a", 1.0, 0), ("a", 1.0, -1), ("a", 1.0, 5)], "a")

    assert asyncio.run(run()) == ["a-1", "a", "a5", "a5"]


@pytest.mark.parametrize("granted", [False, True])
def test_a_cancelled_waiter_passes_its_place_or_its_slot_on(granted):
    async def run() -> tuple[int, int]:
        queue = FairQueue(lambda: 1)
        await queue.acquire("a", 1.0)
        first = asyncio.create_task(queue.acquire("a", 1.0))
        second = asyncio.create_task(queue.acquire("b", 1.0))
        await asyncio.sleep(0)
        if granted:
            queue.release("a")  # the slot goes to one of them, which is cancelled before it runs
            first.cancel()
            second.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
        else:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            queue.release("a")  # the slot goes to the one still waiting
            await second
        return queue.out, queue.num_waiting

    # cancelled after its slot was granted: the slot is released again, not leaked
    assert asyncio.run(run()) == ((0, 0) if granted else (1, 0))


def test_a_tenant_below_its_share_is_sent_on_at_once_and_ranked_ahead_of_one_past_its_share():
    """Four slots, two tenants of equal weight (a share of two each): flood's first two requests are within its
    share, its next two past it, and the rest wait; steady, holding none, is sent on at once past the four
    slots, twice, and its third waits like any other."""

    async def run() -> tuple[list[bool], list[bool], int, int]:
        queue = FairQueue(lambda: 4)
        await queue.acquire("steady", 1.0)  # seen once, then idle
        queue.release("steady")
        flood = [await queue.acquire("flood", 1.0) for _ in range(4)]
        waiting = asyncio.create_task(queue.acquire("flood", 1.0))
        steady = [await queue.acquire("steady", 1.0) for _ in range(2)]
        third = asyncio.create_task(queue.acquire("steady", 1.0))
        await asyncio.sleep(0)
        out, num_waiting = queue.out, queue.num_waiting
        for task in (waiting, third):
            task.cancel()
        await asyncio.gather(waiting, third, return_exceptions=True)
        return flood, steady, out, num_waiting

    flood, steady, out, num_waiting = asyncio.run(run())
    assert flood == [True, True, False, False] and steady == [True, True]
    assert out == 6 and num_waiting == 2


def test_workers_get_twice_the_priority_plus_one_past_the_share_clamped_to_an_int32():
    hold = Hold(FairQueue(lambda: 4), "a", 1.0)
    assert [hold.worker_priority(p) for p in (0, -3, 5)] == [0, -6, 10]
    hold.within_share = False
    assert [hold.worker_priority(p) for p in (0, -3, 5)] == [1, -5, 11]
    assert hold.worker_priority(PRIORITY_RANGE[1]) == PRIORITY_RANGE[1]
    assert hold.worker_priority(PRIORITY_RANGE[0]) == PRIORITY_RANGE[0]
    assert Hold(None, "a", 1.0).worker_priority(5) == 5  # no tenants: the priority as sent
