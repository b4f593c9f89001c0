"""The decode worker's end of the ``grpc`` transfer backend: pushed KV chunks into leased blocks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
import xxhash

from kvstore.kv_cache import KVCache
from kvstore.transfer import checksum, write_blocks
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import CALLER_METADATA


class KVReceiver(pb_grpc.KVTransferServicer):
    """Writes a chunk only when its fingerprint and checksum hold, and every block it names is leased to that
    request and to the prefill worker sending it (the caller's ``x-kvserve-worker``, on a call the token
    interceptor let through). Answers with the checksum of everything written, in order."""

    def __init__(self, kv_cache: KVCache, fingerprint: str,
                 lease_holder: Callable[[str], tuple[list[int], str]]) -> None:  # fmt: skip
        self.kv_cache = kv_cache
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
            write_blocks(self.kv_cache, list(chunk.block_ids), chunk.data)
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
