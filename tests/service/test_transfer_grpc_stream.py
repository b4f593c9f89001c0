"""The grpc transport's receiving end (PushKV): a chunk lands only with the right layout, an intact checksum
and a lease on every block it names, for the prefill worker sending it."""

from __future__ import annotations

import grpc
import pytest
import torch
from service_utils import TEST_SECURITY, InProcessServer

from kvstore import KVCache, KVCacheSpec
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from transfer.blocks import block_nbytes, checksum, read_blocks
from transfer.grpc_stream import GrpcTransport, KVReceiver
from transfer.interface import Origin, TransferFailed

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
LEASED = [2, 3]  # leased to request "r" and prefill worker "prefill-t"


@pytest.fixture(scope="module")
def receiver():
    pool = KVCache(SPEC, 8, "cpu")
    receiver = KVReceiver(pool, "fp-test", lambda request_id: (LEASED, "prefill-t") if request_id == "r" else ([], ""))
    server = InProcessServer({"KVTransfer": receiver})
    yield server, pool
    server.stop()


def _push(address: str, chunk: pb.KVChunk, caller: str = "prefill-t") -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KVTransferStub(channel).PushKV(iter([chunk]), timeout=10, metadata=TEST_SECURITY.metadata(caller))
    return err.value


def _chunk(block_ids: list[int], data: bytes, **fields) -> pb.KVChunk:
    return pb.KVChunk(**{"request_id": "r", "fingerprint": "fp-test", "block_ids": block_ids, "data": data,
                         "checksum": checksum(data), **fields})  # fmt: skip


def test_corrupted_chunk_is_rejected(receiver):
    server, _ = receiver
    data = bytes(block_nbytes(receiver[1]))
    err = _push(server.address, _chunk([2], data, checksum=checksum(data + b"x")))
    assert err.code() == grpc.StatusCode.DATA_LOSS and "fails its checksum" in err.details()


def test_mismatched_fingerprint_is_refused(receiver):
    err = _push(receiver[0].address, _chunk([2], b"", fingerprint="not-ours"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in err.details()


@pytest.mark.parametrize(("blocks", "request_id", "caller"), [([4], "r", "prefill-t"), ([2], "other", "prefill-t"),
                                                              ([2], "r", "prefill-u")])  # fmt: skip
def test_blocks_not_leased_to_that_request_and_caller_are_refused(receiver, blocks, request_id, caller):
    server, pool = receiver
    before = read_blocks(pool, list(range(8)))
    err = _push(server.address, _chunk(blocks, bytes(block_nbytes(pool)), request_id=request_id), caller)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert read_blocks(pool, list(range(8))) == before


def test_the_sender_reports_a_refusal_as_a_failed_transfer(receiver):
    server, pool = receiver
    source = KVCache(SPEC, 8, "cpu")
    transport = GrpcTransport("decode-t", server.address, Origin(SPEC, "fp-test", "prefill-u", TEST_SECURITY))
    with pytest.raises(TransferFailed, match="PERMISSION_DENIED"):
        server.aio.run(transport.finish("r", LEASED, transport.take(source, [0, 1])))
    transport.close()
