"""The decode worker's end of the ``grpc`` transfer backend: pushed KV chunks into reserved blocks."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import xxhash

from kvstore.kv_cache import KVCache
from kvstore.transfer import checksum, write_blocks
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


class KVReceiver(pb_grpc.KVTransferServicer):
    """Verifies each chunk (fingerprint, checksum, destination blocks reserved for that request) and
    writes it into the pool; answers with the checksum of everything written, in order."""

    def __init__(self, kv_cache: KVCache, fingerprint: str, reserved_blocks: Callable[[str], list[int]]) -> None:
        self.kv_cache = kv_cache
        self.fingerprint = fingerprint
        self.reserved_blocks = reserved_blocks  # request id -> its reserved block ids ([] if none)

    def PushKV(self, request_iterator, context: grpc.ServicerContext) -> pb.PushKVResponse:
        hasher, num_chunks, num_bytes = xxhash.xxh3_128(), 0, 0
        for chunk in request_iterator:
            if chunk.fingerprint != self.fingerprint:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"KV fingerprint {chunk.fingerprint!r} differs from this worker's {self.fingerprint!r}",
                )
            if checksum(chunk.data) != chunk.checksum:
                context.abort(
                    grpc.StatusCode.DATA_LOSS, f"KV chunk {num_chunks} of {chunk.request_id} fails its checksum"
                )
            if not set(chunk.block_ids) <= set(self.reserved_blocks(chunk.request_id)):
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"blocks {list(chunk.block_ids)[:4]}... are not reserved for {chunk.request_id!r}",
                )
            try:
                write_blocks(self.kv_cache, list(chunk.block_ids), chunk.data)
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            hasher.update(chunk.data)
            num_chunks += 1
            num_bytes += len(chunk.data)
        return pb.PushKVResponse(num_chunks=num_chunks, num_bytes=num_bytes, checksum=hasher.hexdigest())
