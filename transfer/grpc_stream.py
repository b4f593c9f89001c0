"""The ``grpc`` transport (anywhere, no extra dependency): the prefill worker reads the finished blocks out
of its own pool and streams them to the decode worker's ``KVTransfer.PushKV`` in chunks of
``transfer.blocks.CHUNK_BLOCKS`` blocks, each with the layout's fingerprint and its checksum; the decode
worker (``KVReceiver``) verifies each chunk and writes it into the leased blocks.

Both ends live here because they are one wire format: the receiver's answer is the running checksum of the
chunks' bytes in order, which equals ``checksum_blocks`` over the destination blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import xxhash

from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from security.auth import CALLER_METADATA
from security.identity import Identity
from transfer.backend import Backend
from transfer.blocks import checksum, chunked, read_blocks, write_blocks
from transfer.interface import KVTransport, Origin, TransferFailed

PUSH_TIMEOUT_S = 30.0


class GrpcTransport(KVTransport):
    """Pushes to one decode worker at one address, over one channel (made on first use, on the event loop).
    With cluster certificates the channel accepts only that worker's certificate: the KV goes to it alone.
    Closing it closes the channel once the pushes under way on it are done."""

    backend = Backend.GRPC

    def __init__(self, worker_id: str, address: str, origin: Origin) -> None:
        super().__init__(worker_id)
        self.address = address
        self.origin = origin
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the channel belongs to

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        return f"grpc:{dest.address} {dest.worker_id}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> GrpcTransport:
        return cls(dest.worker_id, dest.address, origin)

    def take(self, source: SplitPool, block_ids: list[int], request_id: str = "", dst_blocks: list[int] = (),
             deadline: float | None = None) -> list[bytes]:  # fmt: skip
        """The blocks' bytes, one ``bytes`` per chunk of ``chunked(block_ids)``."""
        return [read_blocks(source, part) for part in chunked(block_ids)]

    async def finish(self, request_id: str, dst_blocks: list[int], taken: list[bytes]) -> str:
        """Stream ``taken`` into ``dst_blocks`` (chunk ``i`` into ``chunked(dst_blocks)[i]``); the receiver's
        checksum of what it wrote."""
        origin, dst_chunks = self.origin, chunked(dst_blocks)

        async def messages() -> AsyncIterator[pb.KVChunk]:
            for blocks, data in zip(dst_chunks, taken, strict=True):
                yield pb.KVChunk(request_id=request_id, fingerprint=origin.fingerprint, block_ids=blocks, data=data,
                                 checksum=checksum(data))  # fmt: skip

        if self._channel is None:
            self._channel = origin.security.aio_channel(self.address, Identity("decode", self.worker_id))
            self._loop = asyncio.get_running_loop()
        stub = pb_grpc.KVTransferStub(self._channel)
        try:
            reply = await stub.PushKV(messages(), timeout=PUSH_TIMEOUT_S,
                                      metadata=origin.security.metadata(origin.worker_id))  # fmt: skip
        except grpc.aio.AioRpcError as err:
            raise TransferFailed(f"{err.code().name}: {err.details()}") from err
        return reply.checksum

    def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and self._loop.is_running():  # a stopped loop took its channels with it
            asyncio.run_coroutine_threadsafe(channel.close(grace=PUSH_TIMEOUT_S), self._loop)


class KVReceiver(pb_grpc.KVTransferServicer):
    """The decode worker's end: writes a chunk only when its fingerprint and checksum hold, and every block it
    names is leased to that request and to the prefill worker sending it (the caller's ``x-kvserve-worker``,
    on a call the token interceptor let through). Answers with the checksum of everything written, in order."""

    def __init__(self, pool: SplitPool, fingerprint: str,
                 lease_holder: Callable[[str], tuple[list[int], str]]) -> None:  # fmt: skip
        self.pool = pool  # every tensor-parallel rank's part: each chunk's bytes are whole heads
        self.fingerprint = fingerprint
        self.lease_holder = lease_holder  # request id -> (leased block ids, prefill worker id); ([], '') if none
        # Held while a chunk is checked and written, and by the decode loop while it revokes a lease: once
        # revoked, no chunk checked earlier can still land in blocks that are being given to someone else.
        self.lock = threading.Lock()

    def _write_if_leased(self, chunk: pb.KVChunk, caller: str) -> bool:
        with self.lock:
            leased, holder = self.lease_holder(chunk.request_id)
            if not leased or holder != caller or not set(chunk.block_ids) <= set(leased):
                return False
            write_blocks(self.pool, list(chunk.block_ids), chunk.data)
            return True

    async def PushKV(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushKVResponse:
        caller = dict(context.invocation_metadata() or ()).get(CALLER_METADATA, "")
        hasher, num_chunks, num_bytes = xxhash.xxh3_128(), 0, 0
        async for chunk in request_iterator:
            if chunk.fingerprint != self.fingerprint:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"KV fingerprint {chunk.fingerprint!r} differs from this worker's "
                                    f"{self.fingerprint!r}")  # fmt: skip
            if checksum(chunk.data) != chunk.checksum:
                await context.abort(grpc.StatusCode.DATA_LOSS,
                                    f"KV chunk {num_chunks} of {chunk.request_id} fails its checksum")  # fmt: skip
            try:
                # NumPy copy off the event loop (no OpenMP pool: see rpc.loop.Loop)
                written = await asyncio.to_thread(self._write_if_leased, chunk, caller)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            if not written:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"blocks {list(chunk.block_ids)[:4]} are not leased to request "
                                    f"{chunk.request_id!r} and prefill worker {caller!r}")  # fmt: skip
            hasher.update(chunk.data)
            num_chunks += 1
            num_bytes += len(chunk.data)
        return pb.PushKVResponse(num_chunks=num_chunks, num_bytes=num_bytes, checksum=hasher.hexdigest())
