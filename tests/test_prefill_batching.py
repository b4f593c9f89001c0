"""The prefill worker's dynamic batcher and the decode worker's lease, with real servers and a real Redis."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from decode_service.worker import DecodeWorker
from engine import LLMEngine
from kvserve.redis_server import EmbeddedRedis
from kvserve.serving import new_server, start_server
from kvstore.registry import Registry
from kvstore.transfer import checksum_blocks, create_shared_pool
from kvstore.workers import WorkerInfo
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


def _serve_prefill(engine, max_wait_ms):
    worker = PrefillWorker(engine, "prefill-b", max_batch_tokens=4096, max_wait_ms=max_wait_ms)
    worker.loop.start()
    server = new_server()
    pb_grpc.add_PrefillServicer_to_server(worker, server)
    port, _ = start_server(server, ["kvserve.v1.Prefill"], "127.0.0.1:0")
    return worker, server, f"127.0.0.1:{port}"


def test_concurrent_prefills_share_one_batch(engine_prompts):
    engine = LLMEngine(model="default", num_blocks=64, block_size=16)
    worker, server, address = _serve_prefill(engine, max_wait_ms=300)
    pool, path = create_shared_pool(engine.runner.kv_spec, 64, "batch-test")
    try:

        def prefill(i):
            prompt = engine_prompts[i]
            blocks = list(range(16 * i, 16 * i + engine.block_manager.num_blocks_for(len(prompt))))
            dest = pb.KVDestination(worker_id="d", backend="shm", fingerprint=worker.fingerprint, block_ids=blocks,
                                    shm_path=str(path), num_blocks=64)  # fmt: skip
            request = pb.PrefillRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        sampling=pb.SamplingOptions(temperature=0), destination=dest)  # fmt: skip
            with grpc.insecure_channel(address) as channel:
                reply = pb_grpc.PrefillStub(channel).Prefill(request, timeout=60)
            return reply, blocks

        with ThreadPoolExecutor(4) as pool_:
            replies = list(pool_.map(prefill, range(4)))
        assert worker.batch_sizes == [4]  # all four arrived within the batching window
        for reply, blocks in replies:
            assert reply.checksum == checksum_blocks(pool, blocks) and reply.backend == "shm"
        assert engine.block_manager.num_free_blocks == 64  # the prefill worker kept nothing
    finally:
        path.unlink()
        server.stop(0)
        worker.stop()


@pytest.mark.slow
def test_expired_lease_quarantines_blocks_and_the_request_completes(engine_prompts, hf_greedy):
    with EmbeddedRedis() as redis:
        registry = Registry(redis.url, ttl_s=30)
        slow_engine = LLMEngine(model="default", num_blocks=64, block_size=16)
        prefill, prefill_server, prefill_address = _serve_prefill(slow_engine, max_wait_ms=4000)
        # the slow prefill worker is the only one registered; it holds each batch open for 4 s
        prefill_info = WorkerInfo(worker_id="prefill-b", role="prefill", address=prefill_address,
                                  fingerprint=prefill.fingerprint)  # fmt: skip
        registry.register(prefill_info)
        engine = LLMEngine(model="default", num_blocks=32, block_size=16, shared_kv_name="lease-test")
        decode = DecodeWorker(engine, "decode-l", "127.0.0.1:0", Registry(redis.url), prefill_timeout_s=1.0,
                              shm_path=str(engine.runner.kv_pool_path))  # fmt: skip
        decode.loop.start()
        server = new_server()
        pb_grpc.add_DecodeServicer_to_server(decode, server)
        port, _ = start_server(server, ["kvserve.v1.Decode"], "127.0.0.1:0")
        try:
            sampling = pb.SamplingOptions(temperature=0, max_tokens=32, ignore_eos=True)
            request = pb.DecodeRequest(request_id="lease", prompt_token_ids=engine_prompts[5], sampling=sampling)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                messages = list(pb_grpc.DecodeStub(channel).Generate(request, timeout=120))
            assert [t for m in messages for t in m.token_ids] == hf_greedy[5]
            assert messages[-1].transfer_backend == "local"  # the lease expired, so it was prefilled here
            assert decode.num_quarantined == 1  # its first blocks were held back, not reused at once
            time.sleep(4.5)  # past the slow batch window: the abandoned job must not have run
            assert prefill.batch_sizes == [1] and prefill.num_cancelled == 1
            assert slow_engine.block_manager.num_free_blocks == slow_engine.block_manager.num_blocks
            deadline = time.monotonic() + 10  # the late writer finishes; the quarantine ends after the timeout
            while engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
                assert time.monotonic() < deadline, "quarantined blocks were never freed"
                time.sleep(0.1)
        finally:
            server.stop(0)
            decode.stop()
            prefill_server.stop(0)
            prefill.stop()
            engine.close()
            registry.stop()
