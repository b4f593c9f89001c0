"""``rpc.server.add_service``: bytes that are not the method's request message get INVALID_ARGUMENT (gRPC's own
deserializer path answers INTERNAL), for every method kind, while good messages reach the servicer."""

from __future__ import annotations

import grpc
import pytest
from service_utils import TEST_SECURITY, InProcessServer

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

GARBAGE = b"\xff\xff\xff\xff"


class Echo(pb_grpc.PrefillServicer, pb_grpc.KVTransferServicer):
    """Unary-unary ``Prefill`` and stream-unary ``PushKV`` that answer what they received."""

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        return pb.PrefillResponse(worker_id=request.request_id)

    async def PushKV(self, chunks, context) -> pb.PushKVResponse:
        return pb.PushKVResponse(num_chunks=len([c async for c in chunks]))


@pytest.fixture(scope="module")
def channel():
    echo = Echo()
    server = InProcessServer({"Prefill": echo, "KVTransfer": echo})
    with grpc.insecure_channel(server.address) as channel:
        yield channel
    server.stop()


def _raw(channel: grpc.Channel, kind: str, method: str, reply: type):
    return getattr(channel, kind)(method, request_serializer=lambda b: b, response_deserializer=reply.FromString)


def test_unary_request(channel):
    prefill = _raw(channel, "unary_unary", "/kvserve.v1.Prefill/Prefill", pb.PrefillResponse)
    meta = TEST_SECURITY.metadata()
    assert prefill(pb.PrefillRequest(request_id="r1").SerializeToString(), metadata=meta).worker_id == "r1"
    with pytest.raises(grpc.RpcError) as err:
        prefill(GARBAGE, metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request is not a valid kvserve.v1.PrefillRequest message: ")


def test_streamed_requests(channel):
    push = _raw(channel, "stream_unary", "/kvserve.v1.KVTransfer/PushKV", pb.PushKVResponse)
    meta = TEST_SECURITY.metadata()
    good = pb.KVChunk(request_id="r1", data=b"kv").SerializeToString()
    assert push(iter([good, good]), metadata=meta, timeout=10).num_chunks == 2
    with pytest.raises(grpc.RpcError) as err:
        push(iter([good, GARBAGE, good]), metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request is not a valid kvserve.v1.KVChunk message" in err.value.details()


def test_the_token_is_checked_before_the_request_is_read(channel):
    prefill = _raw(channel, "unary_unary", "/kvserve.v1.Prefill/Prefill", pb.PrefillResponse)
    with pytest.raises(grpc.RpcError) as err:
        prefill(GARBAGE, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
