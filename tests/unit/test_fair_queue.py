"""``router.fair_queue.FairQueue``: under contention tenants get slots in proportion to their weights, a tenant
that starts waiting banks no credit from its idle spell, a tenant's own requests go by priority, and a waiter
that is cancelled gives its place (or its slot) on."""

from __future__ import annotations

import asyncio

import pytest

from router.fair_queue import FairQueue


async def _served_order(queue: FairQueue, requests: list[tuple[str, float, int]]) -> list[str]:
    """Queue ``requests`` (tenant, weight, priority) behind a full queue, then free one slot at a time: the
    order in which they got slots."""
    order = []

    async def one(tenant: str, weight: float, priority: int) -> None:
        await queue.acquire(tenant, weight, priority)
        order.append(f"{tenant}{priority}" if priority else tenant)

    tasks = [asyncio.create_task(one(*request)) for request in requests]
    await asyncio.sleep(0)
    for _ in requests:
        queue.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_slots_are_shared_by_weight_under_contention():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        await queue.acquire("flood", 1.0)  # the one slot, taken
        requests = [("flood", 1.0, 0)] * 12 + [("b", 2.0, 0)] * 6
        return await _served_order(queue, requests)

    order = asyncio.run(run())
    # b (weight 2) gets two slots for each of flood's until its 6 are served, though flood queued 12 first
    assert order[:9].count("b") == 6 and order[9:] == ["flood"] * 9


def test_an_idle_tenant_banks_no_credit():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        for _ in range(20):  # a tenant alone: served at once, 20 times
            await queue.acquire("a", 1.0)
            queue.release()
        await queue.acquire("a", 1.0)
        # b was idle through a's 20: it starts level with a, not 20 requests ahead
        return await _served_order(queue, [("b", 1.0, 0)] * 4 + [("a", 1.0, 0)] * 4)

    order = asyncio.run(run())
    assert order[:2] in (["a", "b"], ["b", "a"]) and order[:4].count("b") == 2


def test_a_tenants_requests_go_by_priority_then_arrival():
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        await queue.acquire("a", 1.0)
        return await _served_order(queue, [("a", 1.0, 5), ("a", 1.0, 0), ("a", 1.0, -1), ("a", 1.0, 5)])

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
            queue.release()  # the slot goes to one of them, which is cancelled before it runs
            first.cancel()
            second.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
        else:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            queue.release()  # the slot goes to the one still waiting
            await second
        return queue.out, queue.num_waiting

    # cancelled after its slot was granted: the slot is released again, not leaked
    assert asyncio.run(run()) == ((0, 0) if granted else (1, 0))
