"""Decode admission limits and router fail-over, with in-process servers on real gRPC loopback."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from router_utils import RouterStack, new_router
from service_utils import TEST_SECURITY, InProcessServer

from decode_service.worker import DecodeWorker
from engine import LLMEngine
from kvserve.client import Client
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
        deadline = time.monotonic() + 10
        while worker.load()["num_waiting"] < 1:  # the second request is queued, waiting for blocks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_decode_request([1, 2, 3], 2), metadata=meta))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue limit" in err.value.details()
        assert sum(len(m.token_ids) for m in first) == 26  # the first one finishes normally
        thread.join(timeout=60)
    assert len(second_tokens) == 4  # and the waiting one gets its blocks afterwards
    assert worker.engine.block_manager.num_free_blocks == 8


def test_router_fails_over_to_another_decode_worker(model_dir, caplog):
    """Static decode workers in order: one nothing listens on, one that dies after its health check, a live one.
    The first is never called (its health check fails); the second fails before its first token and the
    request moves on; later requests skip it without trying."""
    stack = RouterStack(model_dir)
    with socket_free_port() as dead_port:  # nothing listens there
        pass
    dying = InProcessServer({"Decode": stack.worker}, aio=stack.aio)  # the same worker on a second port
    router = new_router(model_dir, [f"127.0.0.1:{dead_port}", dying.address, stack.decode.address])
    front = InProcessServer({"Inference": router}, aio=stack.aio)
    options = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    try:
        with Client(front.address, timeout_s=60) as client:
            assert len(client.generate([5, 6, 7, 8], **options).token_ids) == 3  # served on the second port
            dying.stop()
            with caplog.at_level(logging.WARNING, logger="router.server"):
                for _ in range(2):
                    assert len(client.generate([5, 6, 7, 8], **options).token_ids) == 3
        failovers = [r.getMessage() for r in caplog.records if "failed before its first token" in r.getMessage()]
        assert len(failovers) == 1 and dying.address in failovers[0]  # once: the next request skipped it
        assert sum(router._in_flight.values()) == 0
    finally:
        front.stop()
        stack.aio.run(router.close())
        stack.stop()


class socket_free_port:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_router_counts_each_choice_as_it_makes_it(model_dir):
    """Requests between two heartbeats: a request ranks the workers and counts its choices with no await in
    between, so 8 requests split 4/4 over two idle workers of each role, and releases undo the counts."""
    from kvstore.workers import WorkerInfo
    from router.routing import choose

    router = new_router(model_dir, [])
    prefill = [WorkerInfo(worker_id=f"prefill-{i}", role="prefill", address=f"127.0.0.1:{9100 + i}") for i in range(2)]
    decode = [WorkerInfo(worker_id=f"decode-{i}", role="decode", address=f"127.0.0.1:{9200 + i}", free_blocks=100,
                         total_blocks=100) for i in range(2)]  # fmt: skip
    slots = []
    for _ in range(8):
        choice = choose(decode, prefill, {}, 4, router._load, router.weights)
        slots.append((router._claim(choice.prefill), router._claim(choice.decode[0].worker_id)))
    assert sorted(p.key for p, _ in slots) == ["prefill-0"] * 4 + ["prefill-1"] * 4
    assert sorted(d.key for _, d in slots) == ["decode-0"] * 4 + ["decode-1"] * 4
    for p, d in slots:
        p.release()
        d.release()
        d.release()  # harmless
    assert sum(router._in_flight.values()) == 0
