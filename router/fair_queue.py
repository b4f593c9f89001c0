"""``FairQueue``: the router's requests sent on to decode workers, at most as many as those workers run at once,
shared by tenants in proportion to their weights when more wait (weighted fair queuing).

Without it every request goes straight to a decode worker, whose queue is first come, first served (within a
priority): a tenant that sends ten times its share fills that queue, and everyone else's requests wait behind
it. With tenants (``--api-keys-file``) the router holds back what the decode workers could not start at once
(``slots``: their running slots, ``max_num_seqs`` each, from their heartbeats, or ``--fair-queue-slots``), and
when a slot frees it sends the next request of the tenant that has had the least service for its weight.

Each tenant has a virtual time, the requests it was given divided by its weight. The next request goes to the
waiting tenant with the smallest; a tenant that starts waiting after an idle spell starts at the smallest
virtual time of those waiting (never below: it cannot bank credit while idle, nor be punished for a past burst
beyond it). Within a tenant, requests go by priority, then arrival. Lives on the router's event loop (no locks).
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
        self._order = itertools.count()

    async def acquire(self, tenant: str, weight: float, priority: int = 0) -> None:
        """Wait for a slot; release it with ``release`` (also when the caller is cancelled after this returns)."""
        self._weights[tenant] = weight
        if self.out < max(1, self.slots()) and not self._waiting:
            self._charge(tenant)
            self.out += 1
            return
        if tenant not in self._waiting:  # it starts waiting: no credit banked while idle
            floor = min((self._virtual[t] for t in self._waiting), default=self._virtual.get(tenant, 0.0))
            self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), floor)
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
        self._virtual[tenant] = self._virtual.get(tenant, 0.0) + 1 / self._weights[tenant]

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
