"""Decode admission limits and router fail-over, with in-process servers on real gRPC loopback."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from decode_service.worker import DecodeWorker
from engine import LLMEngine
from engine.config import ModelConfig
from kvserve.client import Client
from kvserve.serving import new_server, start_server
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.server import Router


@pytest.fixture(scope="module")
def small_decode():
    """A decode worker with 8 blocks (128 tokens) and room for one request waiting for blocks."""
    engine = LLMEngine(model="default", num_blocks=8, block_size=16)
    worker = DecodeWorker(engine, "decode-small", "127.0.0.1:0", max_waiting=1)
    worker.loop.start()
    server = new_server()
    pb_grpc.add_DecodeServicer_to_server(worker, server)
    port, _ = start_server(server, ["kvserve.v1.Decode"], "127.0.0.1:0")
    yield f"127.0.0.1:{port}", worker
    server.stop(0)
    worker.stop()


def _decode_request(prompt, max_tokens):
    sampling = pb.SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.DecodeRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling)


def test_full_waiting_queue_gets_resource_exhausted(small_decode):
    address, worker = small_decode
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeStub(channel)
        first = stub.Generate(_decode_request(list(range(100, 200)), 27))  # holds 8 of 8 blocks at its end
        next(first)  # running
        second = stub.Generate(_decode_request(list(range(300, 400)), 4))  # waits for blocks
        second_tokens = []
        thread = threading.Thread(target=lambda: second_tokens.extend(t for m in second for t in m.token_ids))
        thread.start()
        deadline = time.monotonic() + 10
        while worker.load()["num_waiting"] < 1:  # the second request is queued, waiting for blocks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_decode_request([1, 2, 3], 2)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue limit" in err.value.details()
        assert sum(len(m.token_ids) for m in first) == 26  # the first one finishes normally
        thread.join(timeout=60)
    assert len(second_tokens) == 4  # and the waiting one gets its blocks afterwards
    assert worker.engine.block_manager.num_free_blocks == 8


def test_router_fails_over_to_another_decode_worker(small_decode, model_dir):
    address, _ = small_decode
    with socket_free_port() as dead_port:  # nothing listens there
        pass
    config = ModelConfig.from_dir(model_dir)
    from engine.tokenizer import Tokenizer

    router = Router(Tokenizer(model_dir), config.vocab_size, config.max_context, None,
                    [f"127.0.0.1:{dead_port}", address])  # fmt: skip
    server = new_server()
    pb_grpc.add_InferenceServicer_to_server(router, server)
    port, _ = start_server(server, ["kvserve.v1.Inference"], "127.0.0.1:0")
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
            result = client.generate([5, 6, 7, 8], max_tokens=3, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 3 and result.decode_worker == "decode-small"
    finally:
        server.stop(0)


class socket_free_port:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_router_counts_each_choice_as_it_makes_it(model_dir):
    """Concurrent requests between two heartbeats: each choice is counted in the same locked step as it is
    made, so 8 simultaneous choices split 4/4 over two idle workers of each role, and releases undo them."""
    from engine.tokenizer import Tokenizer
    from kvserve.redis_server import EmbeddedRedis
    from kvstore.registry import Registry
    from kvstore.workers import WorkerInfo

    config = ModelConfig.from_dir(model_dir)
    with EmbeddedRedis() as redis:
        registry = Registry(redis.url)
        for i in range(2):
            registry.register(WorkerInfo(worker_id=f"prefill-{i}", role="prefill", address=f"127.0.0.1:{9100 + i}"))
            registry.register(WorkerInfo(worker_id=f"decode-{i}", role="decode", address=f"127.0.0.1:{9200 + i}",
                                         free_blocks=100, total_blocks=100))  # fmt: skip
        router = Router(Tokenizer(model_dir), config.vocab_size, config.max_context, registry)
        start = threading.Barrier(8)
        slots = []

        def choose():
            start.wait()
            _, decode = router._decode_targets()
            slots.append((router._claim_prefill(), decode))

        threads = [threading.Thread(target=choose) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        prefill_ids = sorted(p.key for p, _ in slots)
        decode_addresses = sorted(d.key for _, d in slots)
        assert prefill_ids == ["prefill-0"] * 4 + ["prefill-1"] * 4
        assert decode_addresses == ["127.0.0.1:9200"] * 4 + ["127.0.0.1:9201"] * 4
        for p, d in slots:
            p.release()
            d.release()
            d.release()  # harmless
        assert sum(router._in_flight.values()) == 0
