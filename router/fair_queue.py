"""``FairQueue``: the router's requests sent on to decode workers, at most as many as those workers run at once,
shared by tenants in proportion to their weights when more wait (weighted fair queuing).

Without it every request goes straight to a decode worker, whose queue is first come, first served (within a
priority): a tenant that sends ten times its share fills that queue, and everyone else's requests wait behind
it. With tenants (``--api-keys-file``) the router holds back what the decode workers could not start at once
(``slots``: their running slots, ``max_num_seqs`` each, from their heartbeats, or ``--fair-queue-slots``), and
when a slot frees it sends the next request of the tenant that has had the least service for its weight.

A tenant holding fewer slots than its whole share (``share``: the slots times its weight over the weights of
the tenants seen) is sent on at once, past ``slots`` if need be: a tenant that sends one request at a time never
waits for a flood to end. Each request sent on is marked within or past its tenant's share
(``acquire``'s answer): the router sends a worker the priority 2p + 1 for one past it (2p within it), so that
under ``--scheduling-policy priority`` a worker runs requests within their share first, priority for priority,
preempts one past its share for one within it, and holds back the prompts of those past it
(``engine.priorities``).

Each tenant has a virtual time, the requests it was given divided by its weight. The next request goes to the
waiting tenant with the smallest; a tenant that starts waiting after an idle spell starts no lower than the
virtual time at which the last request was given (it cannot bank credit while idle). Within a tenant, requests
go by priority, then arrival. Lives on the router's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from engine.priorities import PRIORITY_RANGE
from rpc import metrics


class FairQueue:
    def __init__(self, slots: Callable[[], int]) -> None:
        self.slots = slots  # how many requests may be out at decode workers now (at least 1 is used)
        self.out = 0
        self._out_by: dict[str, int] = {}  # tenant -> its requests sent on
        self._waiting: dict[str, list[tuple[int, int, asyncio.Future]]] = {}  # tenant -> heap (priority, seq)
        self._virtual: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._now = 0.0  # the virtual time at which the last request was given its slot
        self._order = itertools.count()

    async def acquire(self, tenant: str, weight: float, priority: int = 0) -> bool:
        """Wait for a slot; release it with ``release`` (also when the caller is cancelled after this returns).
        True when the request is within its tenant's share."""
        self._weights[tenant] = weight
        within = self._out_by.get(tenant, 0) < self.share(tenant)
        if within or (self.out < max(1, self.slots()) and not self._waiting):
            self._charge(tenant)
            return within
        if tenant not in self._waiting:  # it starts waiting: no credit banked while idle
            self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), self._now)
            self._waiting[tenant] = []
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting[tenant], (priority, next(self._order), ready))
        metrics.TENANT_QUEUED.labels(tenant).inc()
        self._dispatch()  # (slots may have grown since the last release: more decode workers)
        try:
            return await ready
        except asyncio.CancelledError:
            if ready.done() and not ready.cancelled():  # given a slot as it was cancelled: pass it on
                self.release(tenant)
            else:
                self._forget(tenant, ready)
            raise
        finally:
            metrics.TENANT_QUEUED.labels(tenant).dec()

    def release(self, tenant: str) -> None:
        """A request of ``tenant`` sent on ended: its slot goes to the next waiting request, if any."""
        self.out -= 1
        self._out_by[tenant] -= 1
        self._dispatch()

    def share(self, tenant: str) -> int:
        """The slots ``tenant`` is owed: the slots times its weight over the weights of the tenants seen, rounded
        down (0 where its weight buys no whole slot)."""
        return int(self.slots() * self._weights[tenant] / sum(self._weights.values()))

    def _dispatch(self) -> None:
        while self._waiting and self.out < max(1, self.slots()):
            tenant = min(self._waiting, key=lambda t: (self._virtual[t], t))
            _, _, ready = heapq.heappop(self._waiting[tenant])
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            if ready.done():  # (cancelled: already forgotten)
                continue
            within = self._out_by.get(tenant, 0) < self.share(tenant)
            self._charge(tenant)
            ready.set_result(within)

    def _charge(self, tenant: str) -> None:
        """Count a request of ``tenant`` sent on, and advance its virtual time."""
        self.out += 1
        self._out_by[tenant] = self._out_by.get(tenant, 0) + 1
        start = max(self._virtual.get(tenant, 0.0), self._now)
        self._now = start
        self._virtual[tenant] = start + 1 / self._weights[tenant]

    def _forget(self, tenant: str, ready: asyncio.Future) -> None:
        heap = self._waiting.get(tenant)
        if heap is None:
            return
        heap[:] = [entry for entry in heap if entry[2] is not ready]
        heapq.heapify(heap)
        if not heap:
            del self._waiting[tenant]

    @property
    def num_waiting(self) -> int:
        return sum(len(heap) for heap in self._waiting.values())


class Hold:
    """One request's place in a ``FairQueue`` (None: no queue, or no tenant): ``acquire`` once validated,
    ``release`` when it ended, whether or not it was given a slot (a no-op then)."""

    def __init__(self, queue: FairQueue | None, tenant: str, weight: float) -> None:
        self.queue, self.tenant, self.weight = queue, tenant, weight
        self.held = False
        self.within_share = True

    async def acquire(self, priority: int) -> None:
        if self.queue is not None:
            self.within_share = await self.queue.acquire(self.tenant, self.weight, priority)
            self.held = True

    def worker_priority(self, priority: int) -> int:
        """The priority a worker is sent for ``priority``: 2p, plus 1 past the tenant's share (an int32: exact
        for |p| < 2**30, clamped beyond)."""
        if self.queue is None:
            return priority
        return max(PRIORITY_RANGE[0], min(PRIORITY_RANGE[1], 2 * priority + (not self.within_share)))

    def release(self) -> None:
        if self.held:
            self.held = False
            self.queue.release(self.tenant)
