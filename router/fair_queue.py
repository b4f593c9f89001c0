"""``FairQueue``: the router's requests sent on to decode workers, at most as many as those workers run at once,
shared by tenants in proportion to their weights when more wait (weighted fair queuing).

Without it every request goes straight to a decode worker, whose queue is first come, first served (within a
priority): a tenant that sends ten times its share fills that queue, and everyone else's requests wait behind
it. With tenants (``--api-keys-file``) the router holds back what the decode workers could not start at once
(``slots``: their running slots, ``max_num_seqs`` each, from their heartbeats, or ``--fair-queue-slots``), and
when a slot frees it sends the next request of the tenant that has had the least service for its weight.

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

from rpc import metrics


class FairQueue:
    def __init__(self, slots: Callable[[], int]) -> None:
        self.slots = slots  # how many requests may be out at decode workers now (at least 1 is used)
        self.out = 0
        self._waiting: dict[str, list[tuple[int, int, asyncio.Future]]] = {}  # tenant -> heap (priority, seq)
        self._virtual: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._now = 0.0  # the virtual time at which the last request was given its slot
        self._order = itertools.count()

    async def acquire(self, tenant: str, weight: float, priority: int = 0) -> None:
        """Wait for a slot; release it with ``release`` (also when the caller is cancelled after this returns)."""
        self._weights[tenant] = weight
        if self.out < max(1, self.slots()) and not self._waiting:
            self._charge(tenant)
            self.out += 1
            return
        if tenant not in self._waiting:  # it starts waiting: no credit banked while idle
            self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), self._now)
            self._waiting[tenant] = []
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting[tenant], (priority, next(self._order), ready))
        metrics.TENANT_QUEUED.labels(tenant).inc()
        self._dispatch()  # (slots may have grown since the last release: more decode workers)
        try:
            await ready
        except asyncio.CancelledError:
            if ready.done() and not ready.cancelled():  # given a slot as it was cancelled: pass it on
                self.release()
            else:
                self._forget(tenant, ready)
            raise
        finally:
            metrics.TENANT_QUEUED.labels(tenant).dec()

    def release(self) -> None:
        """A request sent on ended: its slot goes to the next waiting request, if any."""
        self.out -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiting and self.out < max(1, self.slots()):
            tenant = min(self._waiting, key=lambda t: (self._virtual[t], t))
            _, _, ready = heapq.heappop(self._waiting[tenant])
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            if ready.done():  # (cancelled: already forgotten)
                continue
            self._charge(tenant)
            self.out += 1
            ready.set_result(None)

    def _charge(self, tenant: str) -> None:
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

    async def acquire(self, priority: int) -> None:
        if self.queue is not None:
            await self.queue.acquire(self.tenant, self.weight, priority)
            self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.queue.release()
