"""A failure ends the requests it concerns, never the worker: an injected model-step error on a decode worker
and on a prefill worker (real engines and servers; the fault is one raised exception in the model run).
SIGTERM drains a decode worker process: the running request finishes, new ones are turned away. Faults of whole
processes under supervision: tests/cluster/test_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cluster_utils import free_base_port
from service_utils import TEST_SECURITY, InProcessServer

from cluster_state import lease
from decode_service.worker import DecodeWorker
from engine import LLMEngine
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread
from rpc.server import wait_healthy
from security.auth import TOKEN_ENV


def _fail_next_step(engine: LLMEngine) -> threading.Event:
    """Make the engine's next model run raise; the event is set once it has."""
    real, failed = engine.runner.execute, threading.Event()

    def execute(batch):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("injected fault")
        return real(batch)

    engine.runner.execute = execute
    return failed


def _generate(address: str, prompt: list[int], max_tokens: int, metadata=None):
    sampling = pb.SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = pb.DecodeRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling)
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.DecodeStub(channel).Generate(request, timeout=60, metadata=metadata or TEST_SECURITY.metadata())
        return [t for msg in call for t in msg.token_ids]


def test_a_failed_decode_step_fails_its_batch_and_the_worker_serves_on(engine_prompts, hf_greedy):
    engine = LLMEngine(model="default", num_blocks=64, block_size=16)
    aio = AsyncioThread()
    worker = DecodeWorker(engine, "decode-f", "127.0.0.1:0", aio, TEST_SECURITY)
    worker.loop.start()
    server = InProcessServer({"Decode": worker}, aio=aio)
    try:
        failed = _fail_next_step(engine)
        with pytest.raises(grpc.RpcError) as err:
            _generate(server.address, engine_prompts[4], 8)
        assert failed.is_set()
        assert err.value.code() == grpc.StatusCode.INTERNAL and "decode step failed" in err.value.details()
        assert engine.block_manager.num_free_blocks == 64  # the failed request's blocks came back
        assert _generate(server.address, engine_prompts[4], 32) == hf_greedy[4]  # and the loop serves on, exactly
    finally:
        server.stop()
        worker.stop()
        aio.stop()


def test_a_failed_prefill_batch_fails_its_callers_and_the_worker_serves_on(engine_prompts):
    engine = LLMEngine(model="default", num_blocks=64, block_size=16)
    worker = PrefillWorker(engine, "prefill-f", "", TEST_SECURITY)
    worker.loop.start()
    server = InProcessServer({"Prefill": worker})
    try:

        def prefill(request_id: str) -> pb.PrefillResponse:
            dest = pb.KVDestination(worker_id="decode-f", backend="grpc", address="127.0.0.1:1",  # nothing there
                                    fingerprint=worker.fingerprint, block_ids=[0, 1, 2, 3], num_blocks=64)  # fmt: skip
            lease.grant(TEST_SECURITY, request_id, dest, "prefill-f", ttl_s=60)
            request = pb.PrefillRequest(request_id=request_id, prompt_token_ids=engine_prompts[4],
                                        sampling=pb.SamplingOptions(temperature=0), destination=dest)  # fmt: skip
            with grpc.insecure_channel(server.address) as channel:
                return pb_grpc.PrefillStub(channel).Prefill(request, timeout=60, metadata=TEST_SECURITY.metadata())

        failed = _fail_next_step(engine)
        with pytest.raises(grpc.RpcError) as err:
            prefill("first")
        assert failed.is_set()
        assert err.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in err.value.details()
        assert engine.block_manager.num_free_blocks == 64
        # the batcher lives on: the next prefill runs (its push then fails, as no decode worker listens)
        with pytest.raises(grpc.RpcError) as err:
            prefill("second")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker.batch_sizes == [1, 1] and engine.block_manager.num_free_blocks == 64
    finally:
        server.stop()
        worker.stop()


@pytest.mark.slow
def test_sigterm_drains_a_decode_worker(engine_prompts, hf_greedy):
    port = free_base_port()
    env = {**os.environ, TOKEN_ENV: TEST_SECURITY.token}
    proc = subprocess.Popen([sys.executable, "-m", "decode_service", "--port", str(port), "--worker-id", "decode-d",
                             "--num-blocks", "64", "--threads", "1", "--drain-timeout", "60", "--no-shm"],
                            env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        assert wait_healthy(address, 120)
        served, first = [], threading.Event()
        sampling = pb.SamplingOptions(temperature=0, max_tokens=32, ignore_eos=True)
        request = pb.DecodeRequest(request_id="long", prompt_token_ids=engine_prompts[4], sampling=sampling)

        def long_request() -> None:
            with grpc.insecure_channel(address) as channel:
                for msg in pb_grpc.DecodeStub(channel).Generate(request, timeout=120,
                                                                metadata=TEST_SECURITY.metadata()):  # fmt: skip
                    served.extend(msg.token_ids)
                    first.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            _generate(address, [1, 2, 3], 2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        thread.join(60)
        assert served == hf_greedy[4]  # the running request finished, exactly
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
