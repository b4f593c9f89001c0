"""Where a prefill worker's KV goes: the decode workers' pools it writes in place (``shm``, ``cuda_ipc``),
their ``PushKV`` streams (``grpc``), and the leases it ends in Redis once it will never write under them.

Pools and channels are opened on the gRPC event loop, once per decode worker's pool or address; leases are
ended by a thread of their own, so the batcher never waits on Redis.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.registry import Registry
from kvstore.transfer import checksum, chunked, open_cuda_ipc_pool, open_shared_pool
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import Security


class UnknownBackend(ValueError):
    """The destination asks for a transfer backend this worker does not serve."""


class Destinations:
    def __init__(self, spec: KVCacheSpec, fingerprint: str, worker_id: str, security: Security,
                 registry: Registry | None, device: torch.device) -> None:  # fmt: skip
        self.spec = spec
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.security = security
        self.registry = registry
        self.device = device
        self._pools: dict[str, KVCache] = {}  # event loop only
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lease_ends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-ends")

    def close(self) -> None:
        self._lease_ends.shutdown(wait=False)

    def pool(self, dest: pb.KVDestination) -> KVCache | None:
        """The decode worker's pool for ``shm`` and ``cuda_ipc``, opened once per pool; None for ``grpc``.
        Raises ``UnknownBackend`` for another backend, ``OSError``/``RuntimeError``/``ValueError`` when the
        pool cannot be opened."""
        if dest.backend == "grpc":
            return None
        if dest.backend == "shm":
            key = f"shm:{dest.shm_path}"
            if key not in self._pools:
                self._pools[key] = open_shared_pool(self.spec, dest.num_blocks, dest.shm_path)
        elif dest.backend == "cuda_ipc":
            key = f"cuda_ipc:{dest.worker_id}:{dest.cuda_ipc_handle[:64].hex()}"
            if key not in self._pools:
                self._pools[key] = open_cuda_ipc_pool(self.spec, dest.num_blocks, dest.cuda_ipc_handle)
        else:
            raise UnknownBackend(f"transfer backend {dest.backend!r} is not served here")
        return self._pools[key]

    async def push(self, dest: pb.KVDestination, request_id: str, dst_blocks: list[int], chunks: list[bytes]) -> str:
        """Stream ``chunks`` (as ``chunked(dst_blocks)`` splits the blocks) to the decode worker's ``PushKV``;
        its checksum of what it wrote. Raises ``grpc.aio.AioRpcError``."""
        dst_chunks = chunked(dst_blocks)

        async def messages():
            for i, data in enumerate(chunks):
                yield pb.KVChunk(request_id=request_id, fingerprint=self.fingerprint, block_ids=dst_chunks[i],
                                 data=data, checksum=checksum(data))  # fmt: skip

        if dest.address not in self._channels:
            self._channels[dest.address] = self.security.aio_channel(dest.address)
        stub = pb_grpc.KVTransferStub(self._channels[dest.address])
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
