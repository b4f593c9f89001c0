"""The decode worker's admission over real gRPC loopback: a request waits for blocks in a bounded queue, one
more gets RESOURCE_EXHAUSTED naming the limit, and the waiting one runs once blocks are free."""

from __future__ import annotations

import threading

import grpc
import pytest
from service_utils import TEST_SECURITY, InProcessServer
from waiting import wait_until

from decode_service.worker import DecodeWorker
from engine import LLMEngine
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread


@pytest.fixture(scope="module")
def small_decode():
    """A decode worker with 8 blocks (128 tokens) and room for one request waiting for blocks."""
    engine = LLMEngine(model="default", num_blocks=8, block_size=16)
    aio = AsyncioThread()
    worker = DecodeWorker(engine, "decode-small", "127.0.0.1:0", aio, TEST_SECURITY, max_waiting=1)
    worker.loop.start()
    server = InProcessServer({"Decode": worker}, aio=aio)
    yield server.address, worker
    server.stop()
    worker.stop()
    aio.stop()


def _decode_request(prompt, max_tokens):
    sampling = pb.SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.DecodeRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling)


def test_full_waiting_queue_gets_resource_exhausted(small_decode):
    address, worker = small_decode
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeStub(channel)
        meta = TEST_SECURITY.metadata()
        # holds 8 of 8 blocks at its end
        first = stub.Generate(_decode_request(list(range(100, 200)), 27), metadata=meta)
        next(first)  # running
        second = stub.Generate(_decode_request(list(range(300, 400)), 4), metadata=meta)  # waits for blocks
        second_tokens = []
        thread = threading.Thread(target=lambda: second_tokens.extend(t for m in second for t in m.token_ids))
        thread.start()
        wait_until(lambda: worker.load()["num_waiting"] >= 1, 10, "the second request queued, waiting for blocks",
                   interval_s=0.01)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_decode_request([1, 2, 3], 2), metadata=meta))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue limit" in err.value.details()
        assert sum(len(m.token_ids) for m in first) == 26  # the first one finishes normally
        thread.join(timeout=60)
    assert len(second_tokens) == 4  # and the waiting one gets its blocks afterwards
    assert worker.engine.block_manager.num_free_blocks == 8
