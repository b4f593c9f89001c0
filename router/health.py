"""Which registered workers the router may use now: Redis says who exists, a direct gRPC health check says
who answers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.workers import WorkerInfo

log = logging.getLogger(__name__)


class WorkerHealth:
    """A router's view of its workers' health, kept per worker id and start time (``WorkerInfo.started_at``).

    Invariants:
    * a worker is usable only after a health check of its service answered SERVING, and then stays usable
      until ``bench`` is called for it (a call failed with UNAVAILABLE);
    * a worker whose check failed or that was benched is skipped for ``bench_s`` seconds, then checked again
      before its next use;
    * a worker seen with a new start time (it restarted under the same id) is checked afresh;
    * concurrent requests share one check per worker, and a cancelled request does not cancel it.
    """

    def __init__(
        self, channel: Callable[[str], grpc.aio.Channel], bench_s: float = 5.0, probe_timeout_s: float = 2.0
    ) -> None:
        self._channel = channel
        self.bench_s = bench_s
        self.probe_timeout_s = probe_timeout_s
        self._state: dict[str, tuple[float, float | None]] = {}  # id -> (started_at, benched until; None: healthy)
        self._probes: dict[tuple[str, float], asyncio.Future] = {}

    async def usable(self, workers: list[WorkerInfo], service: str) -> list[WorkerInfo]:
        """The workers of ``workers`` that may be used now, in the same order (checking those that need it)."""
        unchecked = [w for w in workers if self._needs_check(w)]
        if unchecked:
            await asyncio.gather(*(self._check(w, service) for w in unchecked))
        return [w for w in workers if self._state.get(w.worker_id) == (w.started_at, None)]

    def bench(self, worker: WorkerInfo) -> None:
        """Skip ``worker`` for ``bench_s`` seconds, then check it again before using it."""
        self._state[worker.worker_id] = (worker.started_at, time.monotonic() + self.bench_s)

    def _needs_check(self, worker: WorkerInfo) -> bool:
        started_at, benched_until = self._state.get(worker.worker_id, (None, None))
        if started_at != worker.started_at:
            return True
        return benched_until is not None and benched_until <= time.monotonic()

    async def _check(self, worker: WorkerInfo, service: str) -> None:
        key = (worker.worker_id, worker.started_at)
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = asyncio.ensure_future(self._probe(worker, service))
            probe.add_done_callback(lambda _: self._probes.pop(key, None))
        await asyncio.shield(probe)

    async def _probe(self, worker: WorkerInfo, service: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel(worker.address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.probe_timeout_s)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            status = f"{err.code().name} {err.details()}"
        if status == "SERVING":
            self._state[worker.worker_id] = (worker.started_at, None)
        else:
            log.warning("worker %s at %s is not usable (%s); skipping it for %.0f s", worker.worker_id,
                        worker.address, status, self.bench_s)  # fmt: skip
            self.bench(worker)
