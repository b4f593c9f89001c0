"""The decode worker's side of ``Prefill`` calls: which prefill worker, under which lease, over which channel,
and the quarantine of blocks a failed call's writer may still touch.

The view of live prefill workers is refreshed from the registry by a task on the gRPC event loop, so the
engine loop never waits on Redis; through a Redis outage it keeps the registry's last-known view. Leases
are written to, read from and deleted in Redis by one publisher thread, in order, never by the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from cluster_state import lease
from cluster_state.lease import LEASE_GRACE_S
from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from decode_service.request import ActiveRequest
from kvstore.block_manager import BlockManager
from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc import metrics
from rpc.convert import sampling_to_proto
from rpc.loop import AsyncioThread
from security.auth import Security
from security.identity import Identity
from transfer.blocks import checksum_blocks

log = logging.getLogger(__name__)
REFRESH_S = 1.0
# A refused call never reached the prefill worker's queue: it will never write, so its blocks are free at once.
_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED)  # fmt: skip


class PrefillClient:
    def __init__(self, aio: AsyncioThread, security: Security, worker_id: str, fingerprint: str,
                 registry: Registry | None, base_timeout_s: float, ms_per_token: float) -> None:  # fmt: skip
        self.base_timeout_s = base_timeout_s
        self.ms_per_token = ms_per_token
        self.aio = aio
        self.security = security
        self.worker_id = worker_id
        self.fingerprint = fingerprint
        self.registry = registry
        self.workers: list[WorkerInfo] = []  # replaced whole by the refresher; read by the engine loop
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}  # by (address, worker id)
        self._refresher = aio.submit(self._refresh_forever()) if registry is not None else None
        # Leases are published for operators and for recovery, off the engine loop, in order (one thread).
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-publisher")

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        self._publisher.shutdown(wait=False)
        for channel in list(self._channels.values()):
            self.aio.submit(channel.close())

    def pick(self, tried: list[str], preferred: str) -> WorkerInfo | None:
        """The preferred prefill worker if live and untried, else the least loaded untried one with our layout."""
        candidates = [w for w in self.workers if w.fingerprint == self.fingerprint and w.worker_id not in tried]
        if not candidates:
            return None
        chosen = [w for w in candidates if w.worker_id == preferred]
        return (chosen or sorted(candidates, key=lambda w: (w.num_running + w.num_waiting, w.worker_id)))[0]

    def timeout_for(self, num_tokens: int) -> float:
        """A prefill's deadline grows with its prompt, so a long prompt is not given up at a fixed 30 s."""
        return self.base_timeout_s + num_tokens * self.ms_per_token / 1000

    def start(self, req: ActiveRequest, target: WorkerInfo, dest: pb.KVDestination, timeout_s: float) -> None:
        """Lease ``dest`` (``req``'s blocks) to ``target`` for ``timeout_s`` and call it; ``req.future`` ends
        with the reply or the ``RpcError``. Cancelling that future cancels the call, which tells the prefill
        worker to drop the job."""
        req.prefill_worker, req.prefill_address = target.worker_id, target.address
        req.tried.append(target.worker_id)
        # the blocks offered for reading hold our prefix cache's KV of these tokens: the lease names them
        lease.grant(self.security, req.request_id, dest, target.worker_id, timeout_s,
                    req.tokens[: req.num_cached_tokens] if dest.cached_block_ids else (), req.num_cached_tokens)
        call = pb.PrefillRequest(request_id=req.request_id, prompt_token_ids=req.tokens,
                                 sampling=sampling_to_proto(req.params), destination=dest,
                                 num_cached_tokens=req.num_cached_tokens)  # fmt: skip
        call.sampling.priority = req.priority  # (not a sampling parameter: the prefill worker's queue order)
        req.prefill_sent_at = time.perf_counter()
        req.prefill_span = req.span.child("decode.remote_prefill", prefill_worker=target.worker_id,
                                          backend=dest.backend, leased_blocks=len(dest.block_ids),
                                          offered_cached_blocks=len(dest.cached_block_ids),
                                          cached_tokens=req.num_cached_tokens)  # fmt: skip
        req.future = self.aio.submit(self._call(target, call, timeout_s, req.prefill_span.metadata()))
        self.publish_lease(req, timeout_s)

    def publish_lease(self, req: ActiveRequest, ttl_s: float) -> None:
        """Write ``req``'s lease to ``kvserve:lease:{request_id}``. It expires by itself after ``ttl_s`` and the
        grace, so that the writer can still end it (and free the blocks early) while they are held back."""
        if self.registry is not None:
            self._publisher.submit(self.registry.put_lease, req.request_id, self.worker_id, req.prefill_worker,
                                   list(req.leased), ttl_s + LEASE_GRACE_S)  # fmt: skip

    def delete_lease(self, request_id: str, writer: str) -> None:
        """Delete ``request_id``'s lease from Redis if it still names ``writer`` (a retry may have replaced it)."""
        if self.registry is not None:
            self._publisher.submit(self.registry.delete_lease, request_id, writer)

    def ended_leases(self, leases: list[tuple[str, str, str]]) -> Future:
        """A future of the (request id, writer) pairs among ``leases`` (request id, writer, its address) that
        no write can reach any more: the writer ended its lease in Redis, or nothing listens at its address."""

        def ended(rid: str, writer: str, address: str) -> bool:
            got = self.registry.get_lease(rid) if self.registry is not None else None
            return (got is not None and got.prefill_id == writer and got.ended) or listener_gone(address)

        return self._publisher.submit(lambda: {(rid, writer) for rid, writer, address in leases
                                               if ended(rid, writer, address)})  # fmt: skip

    def outcome(self, req: ActiveRequest, kv_cache: SplitPool, num_blocks: int) -> tuple[pb.PrefillResponse | None,
                                                                                  str | None, bool]:
        """(reply, error, writer_done) of a finished, expired or abandoned call: ``error`` is None when the KV
        arrived intact (our checksum of the first ``num_blocks`` leased blocks matches the writer's);
        ``writer_done`` says no late write can still land in the blocks."""
        if not req.future.done():
            req.future.cancel()  # the lease expired: the prefill worker drops the job
        if req.future.cancelled():
            return None, "lease expired", False
        if (exc := req.future.exception()) is not None:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            return None, f"{code.name}: {exc.details()}" if code else f"{type(exc).__name__}: {exc}", code in _REFUSED
        reply: pb.PrefillResponse = req.future.result()
        written = req.leased[:num_blocks]
        if reply.checksum != checksum_blocks(kv_cache, written):
            return None, "checksum of the written KV does not match", False
        req.num_cached_tokens = max(req.num_cached_tokens, reply.num_cached_tokens)  # ours, or P's own hit
        metrics.HANDOFF.labels(req.backend).observe(time.perf_counter() - req.prefill_sent_at)
        metrics.TRANSFER_BYTES.labels(req.backend).inc(len(written) * kv_cache.spec.bytes_per_block())
        return reply, None, True

    def _channel(self, target: WorkerInfo) -> grpc.aio.Channel:
        # with cluster certificates, TLS lets the prompt go only to a server whose certificate names ``target``
        key = (target.address, target.worker_id)
        if key not in self._channels:
            self._channels[key] = self.security.aio_channel(target.address, Identity("prefill", target.worker_id))
        return self._channels[key]

    async def _call(self, target: WorkerInfo, request: pb.PrefillRequest, timeout_s: float,
                    trace: tuple[tuple[str, str], ...]) -> pb.PrefillResponse:  # fmt: skip
        stub = pb_grpc.PrefillStub(self._channel(target))
        metadata = self.security.metadata(self.worker_id) + trace
        return await stub.Prefill(request, timeout=timeout_s, metadata=metadata)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                self.workers = await asyncio.to_thread(self.registry.workers, "prefill")
                # connect to each new prefill worker now, not on its first request: that request's TTFT would
                # pay the TCP (and TLS) handshake, and a call cancelled while still connecting never reaches
                # the writer, whose lease then holds our blocks until it runs out
                for target in self.workers:
                    self._channel(target).get_state(try_to_connect=True)
            except Exception:  # noqa: BLE001 - keep the last view; the registry logs outages itself
                log.exception("refreshing the prefill workers failed")
            await asyncio.sleep(REFRESH_S if self.workers else REFRESH_S / 10)  # find the first one fast


def listener_gone(address: str) -> bool:
    """Whether nothing listens at ``address`` (``host:port``) any more: the connection is refused.

    The writers that quarantine waits for (``shm``, ``cuda_ipc``) run on this host, so a refusal is no
    network fault: the prefill worker's process is gone, or has closed its port, which it does only after
    its batcher (the only thing that writes) has stopped. A worker restarted on the same port listens
    again, but it has ended its predecessor's leases itself."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


@dataclass
class _Held:
    deadline: float  # when the lease's grace runs out (monotonic)
    owner: str  # the blocks' owner name in the block manager meanwhile
    request_id: str
    writer: str  # the prefill worker the lease named
    address: str  # where it served


class Quarantine:
    """Blocks that a failed or abandoned prefill may still write into (``shm``, ``cuda_ipc``), held under a new
    owner name and never handed to another request until no write can land: its writer has ended the lease
    (in Redis, signed: it stopped writing, or it is a restarted worker whose predecessor died), nothing
    listens at the writer's address any more (it died and was not restarted), or ``LEASE_GRACE_S`` has passed
    since the lease ran out (never at the expiry itself: a step under way then may still be storing). That is
    checked off the engine loop, at most every ``POLL_S``; failing all of it, the deadline decides."""

    POLL_S = 0.2

    def __init__(self, block_manager: BlockManager, prefills: PrefillClient) -> None:
        self.block_manager = block_manager
        self.prefills = prefills
        self._held: list[_Held] = []
        self._poll: Future | None = None
        self._polled_at = 0.0
        self.num_held = 0  # reservations ever quarantined
        self.num_freed_early = 0  # ... and freed before their lease and its grace ran out

    def hold(self, request_id: str, writer: str, address: str, lease_deadline: float) -> None:
        """Hold ``request_id``'s blocks, leased to ``writer`` until ``lease_deadline`` (monotonic)."""
        owner = f"{request_id}#stale-{time.monotonic_ns()}"
        self.block_manager.rename(request_id, owner)
        self._held.append(_Held(lease_deadline + LEASE_GRACE_S, owner, request_id, writer, address))
        self.num_held += 1

    def free_ended(self) -> None:
        """Free the held blocks no writer can touch any more (the engine loop calls this every iteration)."""
        if not self._held:
            return
        ended: set[tuple[str, str]] = set()
        if self._poll is not None and self._poll.done():
            ended = self._poll.result() if self._poll.exception() is None else set()
            self._poll = None
        now = time.monotonic()
        kept = []
        for held in self._held:
            early = (held.request_id, held.writer) in ended
            if early or held.deadline <= now:
                self.block_manager.free(held.owner)
                self.prefills.delete_lease(held.request_id, held.writer)
                self.num_freed_early += early
            else:
                kept.append(held)
        self._held = kept
        if kept and self._poll is None and now - self._polled_at >= self.POLL_S:
            self._polled_at = now
            self._poll = self.prefills.ended_leases([(h.request_id, h.writer, h.address) for h in kept])
