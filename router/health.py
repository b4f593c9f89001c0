"""Which workers the router may use now: Redis says who exists, a direct gRPC health check says who answers,
and a worker the router knows stays routable while it answers, whatever Redis says meanwhile.

Redis is advisory. It can restart empty (the supervisor restarts a killed Redis in under a second, and the
workers register again within a heartbeat or two), or pause long enough that every worker's entry expires
at once. Routing on Redis alone refused every request in that gap although every worker was alive; so the
router remembers each worker it has seen, and one that Redis no longer lists stays in its view for as long
as its health check, repeated every ``recheck_s``, says SERVING. A worker that stopped (deregistered, then
NOT_SERVING or gone) fails that check and is forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster_state.workers import WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class _Status:
    started_at: float  # the worker start it describes (``WorkerInfo.started_at``)
    serving: bool  # the last check answered SERVING, and no call failed with UNAVAILABLE since
    checked_at: float  # monotonic time of that check (or of the failed call)


class WorkerHealth:
    """A router's view of its workers, kept per worker id and start time (``WorkerInfo.started_at``).

    Invariants:
    * a worker is usable only after a health check of its service answered SERVING; it stays usable until
      ``bench`` is called for it (a call failed with UNAVAILABLE) or, while Redis does not list it, until a
      check repeated every ``recheck_s`` fails;
    * a worker whose check failed or that was benched is checked again after ``bench_s`` seconds (short: a
      restarted worker gets traffic as soon as it serves);
    * a worker seen with a new start time (it restarted under the same id) is checked afresh, at once;
    * a worker Redis stopped listing is kept (with its last-known description) while it answers, and
      forgotten at its first failed check;
    * concurrent requests share one check per worker, and a cancelled request does not cancel it.
    """

    def __init__(self, channel: Callable[[WorkerInfo], grpc.aio.Channel], bench_s: float = 1.0,
                 probe_timeout_s: float = 2.0, recheck_s: float = 2.0) -> None:  # fmt: skip
        self._channel = channel
        self.bench_s = bench_s
        self.probe_timeout_s = probe_timeout_s
        self.recheck_s = recheck_s
        self._status: dict[str, _Status] = {}
        self._known: dict[str, WorkerInfo] = {}  # every worker seen and not yet found gone, by id
        self._probes: dict[tuple[str, float], asyncio.Future] = {}

    async def usable(self, listed: list[WorkerInfo], service: str) -> list[WorkerInfo]:
        """The workers that may be used now: those of ``listed`` (what Redis says now, in its order), then the
        known workers of ``service`` it no longer lists (by id), checking each that needs it."""
        listed_ids = {w.worker_id for w in listed}
        for worker in listed:
            self._known[worker.worker_id] = worker
        unlisted = [w for w in self._known.values() if w.worker_id not in listed_ids and w.role == _role(service)]
        candidates = [*listed, *sorted(unlisted, key=lambda w: w.worker_id)]
        unchecked = [w for w in candidates if self._needs_check(w, w.worker_id not in listed_ids)]
        if unchecked:
            await asyncio.gather(*(self._check(w, service) for w in unchecked))
        for worker in unlisted:  # gone from Redis and not answering: forget it
            if not self._is_usable(worker):
                self._known.pop(worker.worker_id, None)
        return [w for w in candidates if self._is_usable(w)]

    def bench(self, worker: WorkerInfo) -> None:
        """Skip ``worker`` until a check, ``bench_s`` seconds from now, says it serves again."""
        self._status[worker.worker_id] = _Status(worker.started_at, False, time.monotonic())

    def _is_usable(self, worker: WorkerInfo) -> bool:
        status = self._status.get(worker.worker_id)
        return status is not None and status.serving and status.started_at == worker.started_at

    def _needs_check(self, worker: WorkerInfo, unlisted: bool) -> bool:
        status = self._status.get(worker.worker_id)
        if status is None or status.started_at != worker.started_at:
            return True
        age = time.monotonic() - status.checked_at
        return age >= self.bench_s if not status.serving else unlisted and age >= self.recheck_s

    async def _check(self, worker: WorkerInfo, service: str) -> None:
        key = (worker.worker_id, worker.started_at)
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = asyncio.ensure_future(self._probe(worker, service))
            probe.add_done_callback(lambda _: self._probes.pop(key, None))
        await asyncio.shield(probe)

    async def _probe(self, worker: WorkerInfo, service: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel(worker))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.probe_timeout_s)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            status = f"{err.code().name} {err.details()}"
        serving = status == "SERVING"
        self._status[worker.worker_id] = _Status(worker.started_at, serving, time.monotonic())
        if not serving:
            log.warning("worker %s at %s is not usable (%s); checking it again in %.0f s", worker.worker_id,
                        worker.address, status, self.bench_s)  # fmt: skip


def _role(service: str) -> str:
    """``kvserve.v1.Decode`` -> ``decode``."""
    return service.rsplit(".", 1)[-1].lower()
