"""The decode worker's side of ``Prefill`` calls: which prefill worker, under which lease, over which channel.

The view of live prefill workers is refreshed from the registry by a task on the gRPC event loop, so the
engine loop never waits on Redis; through a Redis outage it keeps the registry's last-known view.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

import grpc

from kvstore.registry import Registry
from kvstore.workers import WorkerInfo
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import Security
from rpc.loop import AsyncioThread

log = logging.getLogger(__name__)
REFRESH_S = 1.0


class PrefillClient:
    def __init__(self, aio: AsyncioThread, security: Security, worker_id: str, fingerprint: str,
                 registry: Registry | None) -> None:  # fmt: skip
        self.aio = aio
        self.security = security
        self.worker_id = worker_id
        self.fingerprint = fingerprint
        self.registry = registry
        self.workers: list[WorkerInfo] = []  # replaced whole by the refresher; read by the engine loop
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refresher = aio.submit(self._refresh_forever()) if registry is not None else None

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for channel in list(self._channels.values()):
            self.aio.submit(channel.close())

    def pick(self, tried: list[str], preferred: str) -> WorkerInfo | None:
        """The preferred prefill worker if live and untried, else the least loaded untried one with our layout."""
        candidates = [w for w in self.workers if w.fingerprint == self.fingerprint and w.worker_id not in tried]
        if not candidates:
            return None
        chosen = [w for w in candidates if w.worker_id == preferred]
        return (chosen or sorted(candidates, key=lambda w: (w.num_running + w.num_waiting, w.worker_id)))[0]

    def call(self, address: str, request: pb.PrefillRequest, timeout_s: float) -> Future:
        """Start the call on the event loop; the returned future ends with the reply or the ``RpcError``.
        Cancelling the future cancels the call, which tells the prefill worker to drop the job."""
        return self.aio.submit(self._call(address, request, timeout_s))

    async def _call(self, address: str, request: pb.PrefillRequest, timeout_s: float) -> pb.PrefillResponse:
        if address not in self._channels:
            self._channels[address] = self.security.aio_channel(address)
        stub = pb_grpc.PrefillStub(self._channels[address])
        return await stub.Prefill(request, timeout=timeout_s, metadata=self.security.metadata(self.worker_id))

    async def _refresh_forever(self) -> None:
        while True:
            try:
                self.workers = await asyncio.to_thread(self.registry.workers, "prefill")
            except Exception:  # noqa: BLE001 - keep the last view; the registry logs outages itself
                log.exception("refreshing the prefill workers failed")
            await asyncio.sleep(REFRESH_S)
