"""Where a prefill worker's KV goes: the decode workers' pools it writes in place (``shm``, ``cuda_ipc``),
their ``PushKV`` streams (``grpc``), and the leases it ends in Redis once it will never write under them.

Pools and channels are opened on the gRPC event loop, once per decode worker's pool or address; leases are
ended by a thread of their own, so the batcher never waits on Redis.

A pool is closed once its decode worker is gone, for a dead worker's pool pins its whole size in memory (a
removed file's pages stay while anyone maps it) and every restart makes a new one (``pool_file_name``):

* ``shm``: its file was removed (we keep it open: ``st_nlink`` drops to 0). The supervisor removes a dead
  decode worker's pool file, a stopping worker its own, and a standalone worker its dead predecessors';
* either backend: a newer pool of the same decode worker id arrives (it was restarted).

Every request's lookup looks, and so does the batcher after every turn (at most once per ``SWEEP_S``), so
pools close while no request comes too. Closing drops only our reference: a job still writing there (and
the engine's sequence for it) holds the pool, and its mapping ends with the last of them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.registry import Registry
from kvstore.transfer import checksum, chunked, open_cuda_ipc_pool, open_shared_pool
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import Security
from rpc.identity import Identity

SWEEP_S = 1.0  # the batcher looks for pools whose decode worker is gone at most this often

log = logging.getLogger(__name__)


class UnknownBackend(ValueError):
    """The destination asks for a transfer backend this worker does not serve."""


@dataclass
class _OpenPool:
    """A decode worker's pool as we opened it; ``file`` (``shm``) is its pool file, held open to see it removed."""

    pool: KVCache
    worker_id: str
    file: int | None = None

    def removed(self) -> bool:
        return self.file is not None and os.fstat(self.file).st_nlink == 0


class Destinations:
    def __init__(self, spec: KVCacheSpec, fingerprint: str, worker_id: str, security: Security,
                 registry: Registry | None, device: torch.device) -> None:  # fmt: skip
        self.spec = spec
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.security = security
        self.registry = registry
        self.device = device
        self._pools: dict[str, _OpenPool] = {}  # under _pools_lock: the event loop opens, the batcher closes too
        self._pools_lock = threading.Lock()
        self._next_sweep = 0.0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lease_ends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-ends")

    def close(self) -> None:
        self._lease_ends.shutdown(wait=False)
        with self._pools_lock:
            for key in list(self._pools):
                self._close(key, "the prefill worker stops")

    def pool(self, dest: pb.KVDestination) -> KVCache | None:
        """The decode worker's pool for ``shm`` and ``cuda_ipc``, opened once per pool; None for ``grpc``.
        Raises ``UnknownBackend`` for another backend, ``OSError``/``RuntimeError``/``ValueError`` when the
        pool cannot be opened."""
        if dest.backend == "grpc":
            return None
        if dest.backend == "shm":
            key = f"shm:{dest.shm_path}"
        elif dest.backend == "cuda_ipc":
            key = f"cuda_ipc:{dest.worker_id}:{dest.cuda_ipc_handle[:64].hex()}"
        else:
            raise UnknownBackend(f"transfer backend {dest.backend!r} is not served here")
        with self._pools_lock:
            self._close_removed()
            if key not in self._pools:
                opened = self._open(dest)
                for older in [k for k, p in self._pools.items() if p.worker_id == dest.worker_id]:
                    self._close(older, "a newer pool of the same decode worker arrived: it was restarted")
                self._pools[key] = opened
            return self._pools[key].pool

    def close_gone_pools(self) -> None:
        """Close the pools whose decode worker is gone (their file removed), at most once per ``SWEEP_S``: the
        batcher calls this after every turn, so they close while no request comes too."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        with self._pools_lock:
            self._close_removed()

    def _open(self, dest: pb.KVDestination) -> _OpenPool:
        if dest.backend == "cuda_ipc":
            return _OpenPool(open_cuda_ipc_pool(self.spec, dest.num_blocks, dest.cuda_ipc_handle), dest.worker_id)
        file = os.open(dest.shm_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pool = open_shared_pool(self.spec, dest.num_blocks, dest.shm_path)
            held, mapped = os.fstat(file), os.stat(dest.shm_path)
            if (held.st_dev, held.st_ino) != (mapped.st_dev, mapped.st_ino):
                raise ValueError(f"{dest.shm_path} was replaced while it was being mapped")
        except BaseException:
            os.close(file)
            raise
        return _OpenPool(pool, dest.worker_id, file)

    def _close_removed(self) -> None:
        for key in [key for key, opened in self._pools.items() if opened.removed()]:
            self._close(key, "its pool file was removed: the decode worker is gone")

    def _close(self, key: str, reason: str) -> None:
        """Forget the pool ``key``: it is unmapped once no job holds it any more."""
        opened = self._pools.pop(key)
        if opened.file is not None:
            os.close(opened.file)
        log.info("closed decode worker %s's KV pool %s: %s", opened.worker_id, key, reason)

    async def push(self, dest: pb.KVDestination, request_id: str, dst_blocks: list[int], chunks: list[bytes]) -> str:
        """Stream ``chunks`` (as ``chunked(dst_blocks)`` splits the blocks) to the decode worker's ``PushKV``;
        its checksum of what it wrote. Raises ``grpc.aio.AioRpcError``."""
        dst_chunks = chunked(dst_blocks)

        async def messages():
            for i, data in enumerate(chunks):
                yield pb.KVChunk(request_id=request_id, fingerprint=self.fingerprint, block_ids=dst_chunks[i],
                                 data=data, checksum=checksum(data))  # fmt: skip

        key = f"{dest.address} {dest.worker_id}"  # cluster certificates: the KV goes to that worker only
        if key not in self._channels:
            self._channels[key] = self.security.aio_channel(dest.address, Identity("decode", dest.worker_id))
        stub = pb_grpc.KVTransferStub(self._channels[key])
        reply = await stub.PushKV(messages(), timeout=30, metadata=self.security.metadata(self.worker_id))
        return reply.checksum

    def end_lease(self, request_id: str, state: str) -> None:
        """End our lease for ``request_id`` (``success`` or ``failed``): we will never write under it again
        (the batcher's thread calls this). On a GPU the copies are still queued on the stream, so the Redis
        thread waits for them first."""
        if self.registry is None:
            return
        written = None
        if self.device.type == "cuda":
            written = torch.cuda.Event()
            written.record()

        def end() -> None:
            if written is not None:
                written.synchronize()
            self.registry.end_lease(request_id, self.worker_id, state)

        self._lease_ends.submit(end)
