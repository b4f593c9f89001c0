"""The router uses a registered worker only once a direct gRPC health check answered, and skips one whose
call failed for a while: Redis says who exists, health checks say who answers. Requests waiting on a worker
hold coroutines, not threads."""

from __future__ import annotations

import logging
import socket
import time

import grpc
import pytest
from router_utils import RouterStack, new_router
from service_utils import TEST_SECURITY, InProcessServer

from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from kvserve.client import Client, build_request
from kvserve.launcher.redis_server import EmbeddedRedis
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.health import WorkerHealth
from rpc.loop import AsyncioThread

DECODE = "kvserve.v1.Decode"


def _unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_health_is_checked_once_per_worker_start_and_again_after_a_bench():
    aio = AsyncioThread()
    server = InProcessServer({"Decode": pb_grpc.DecodeServicer()}, aio=aio)  # answers health checks only
    health = WorkerHealth(lambda worker: TEST_SECURITY.aio_channel(worker.address), bench_s=0.3)
    live = WorkerInfo(worker_id="decode-a", role="decode", address=server.address, started_at=1.0)
    dead = WorkerInfo(worker_id="decode-b", role="decode", address=_unused_address(), started_at=1.0)
    try:
        assert aio.run(health.usable([dead, live], DECODE)) == [live]
        server.stop()
        assert aio.run(health.usable([live], DECODE)) == [live]  # checked once for this start: not again
        restarted = WorkerInfo(worker_id="decode-a", role="decode", address=server.address, started_at=2.0)
        assert aio.run(health.usable([restarted], DECODE)) == []  # a new start is checked afresh
        server = InProcessServer({"Decode": pb_grpc.DecodeServicer()}, aio=aio)
        back = WorkerInfo(worker_id="decode-a", role="decode", address=server.address, started_at=3.0)
        assert aio.run(health.usable([back], DECODE)) == [back]
        health.bench(back)  # as after a call that failed with UNAVAILABLE
        assert aio.run(health.usable([back], DECODE)) == []
        time.sleep(0.35)
        assert aio.run(health.usable([back], DECODE)) == [back]  # checked again after the bench, and fine
    finally:
        server.stop()
        aio.stop()


def test_a_known_worker_stays_usable_while_redis_lists_nothing_and_is_forgotten_once_gone():
    """Redis restarted empty (or paused past every TTL): the router keeps the workers it knows while they
    answer, instead of refusing every request until they register again."""
    aio = AsyncioThread()
    server = InProcessServer({"Decode": pb_grpc.DecodeServicer()}, aio=aio)
    health = WorkerHealth(lambda worker: TEST_SECURITY.aio_channel(worker.address), bench_s=0.2, recheck_s=0.2)
    worker = WorkerInfo(worker_id="decode-a", role="decode", address=server.address, started_at=1.0)
    try:
        assert aio.run(health.usable([worker], DECODE)) == [worker]
        assert aio.run(health.usable([], DECODE)) == [worker]  # Redis lists nobody: still ours
        assert aio.run(health.usable([], "kvserve.v1.Prefill")) == []  # known as a decode worker only
        time.sleep(0.25)
        assert aio.run(health.usable([], DECODE)) == [worker]  # checked again while unlisted, and it answers
        server.stop()
        time.sleep(0.25)
        assert aio.run(health.usable([], DECODE)) == []  # checked again: gone, and forgotten
        assert aio.run(health.usable([worker], DECODE)) == []  # still listed (a stale entry): checked, down
    finally:
        server.stop()
        aio.stop()


def test_router_serves_from_the_registered_worker_that_answers(model_dir, caplog):
    with EmbeddedRedis() as redis:  # started first: it forks, which gRPC's threads do not like
        stack = RouterStack(model_dir)
        registry = Registry(redis.url, security=TEST_SECURITY)
        # first by id and idle, but nothing listens there: without a health check it would be called first
        registry.register(WorkerInfo(worker_id="decode-a", role="decode", address=_unused_address()))
        registry.register(WorkerInfo(worker_id="decode-b", role="decode", address=stack.decode.address))
        router = new_router(model_dir, [], registry=registry)
        front = InProcessServer({"Inference": router}, aio=stack.aio)
        try:
            with Client(front.address, timeout_s=60) as client, caplog.at_level(logging.WARNING):
                result = client.generate([5, 6, 7], max_tokens=2, temperature=0, ignore_eos=True)
            assert len(result.token_ids) == 2 and result.decode_worker == stack.worker.worker_id
            messages = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("worker decode-a at ") and "is not usable" in m for m in messages)
            assert not any("failed before its first token" in m for m in messages)  # it was never called
        finally:
            front.stop()
            stack.aio.run(router.close())
            registry.stop()
            stack.stop()


def test_streams_waiting_on_a_silent_worker_do_not_starve_new_calls(model_dir):
    """120 streams wait on a worker that accepts connections and never answers (a thread per stream, as the
    router once had, starved every call after the 64th); a new call is still answered at once."""
    aio = AsyncioThread()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(200)  # the kernel completes handshakes; nobody ever speaks HTTP/2 on them
        router = new_router(model_dir, [f"127.0.0.1:{silent.getsockname()[1]}"])
        router.health.probe_timeout_s = 5.0
        front = InProcessServer({"Inference": router}, aio=aio)
        try:
            with grpc.insecure_channel(front.address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                waiting = [stub.Generate(build_request([1, 2, 3], max_tokens=1), timeout=30) for _ in range(120)]
                time.sleep(0.5)
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(build_request([1, 2, 3], max_tokens=0), timeout=30))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert time.monotonic() - started < 1.0
                assert not any(call.done() for call in waiting)  # all still waiting for the health check
                assert {call.code() for call in waiting} == {grpc.StatusCode.UNAVAILABLE}  # which then fails
        finally:
            front.stop()
            aio.run(router.close())
            aio.stop()
