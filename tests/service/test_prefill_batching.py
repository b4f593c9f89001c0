"""The prefill worker's dynamic batcher and the decode worker's lease, with real servers and a real Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import xxhash
from service_utils import TEST_SECURITY, InProcessServer
from waiting import wait_until

from cluster_state import lease
from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from decode_service.worker import DecodeWorker
from engine import LLMEngine
from kvserve.launcher.redis_server import EmbeddedRedis
from kvstore.shared_pool import create_shared_pool
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread


def _file_checksum(path, pool, block_ids: list[int]) -> str:
    """The hand-off checksum recomputed from the pool file read with plain file I/O, not through any mapping:
    for each chunk of 16 blocks, each layer's K then V region, those blocks in order (the documented order)."""
    raw = Path(path).read_bytes()
    base = pool.buffer.data_ptr()
    hasher = xxhash.xxh3_128()
    for start in range(0, len(block_ids), 16):
        for layer in pool.layers:
            for region in (layer.k_cache, layer.v_cache):
                offset, block_bytes = region.data_ptr() - base, region[0].numel() * region.element_size()
                for block in block_ids[start : start + 16]:
                    hasher.update(raw[offset + block * block_bytes : offset + (block + 1) * block_bytes])
    return hasher.hexdigest()


def _serve_prefill(engine, max_wait_ms, registry=None):
    worker = PrefillWorker(engine, "prefill-b", "", TEST_SECURITY, max_batch_tokens=4096, max_wait_ms=max_wait_ms,
                           registry=registry)  # fmt: skip
    worker.loop.start()
    server = InProcessServer({"Prefill": worker})
    return worker, server, server.address


def test_concurrent_prefills_share_one_batch(engine_prompts):
    engine = LLMEngine(model="default", num_blocks=64, block_size=16)
    worker, server, address = _serve_prefill(engine, max_wait_ms=300)
    pool, path = create_shared_pool(engine.runner.kv_spec, 64, "batch-test")
    try:

        def prefill(i):
            prompt = engine_prompts[i]
            blocks = list(range(16 * i, 16 * i + engine.block_manager.num_blocks_for(len(prompt))))
            dest = pb.KVDestination(worker_id="batch-test", backend="shm", fingerprint=worker.fingerprint,
                                    block_ids=blocks, shm_path=str(path), num_blocks=64)  # fmt: skip
            lease.grant(TEST_SECURITY, f"r{i}", dest, "prefill-b", ttl_s=60)
            request = pb.PrefillRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        sampling=pb.SamplingOptions(temperature=0), destination=dest)  # fmt: skip
            with grpc.insecure_channel(address) as channel:
                reply = pb_grpc.PrefillStub(channel).Prefill(request, timeout=60,
                                                             metadata=TEST_SECURITY.metadata("batch-test"))
            return reply, blocks

        with ThreadPoolExecutor(4) as pool_:
            replies = list(pool_.map(prefill, range(4)))
        assert worker.batch_sizes == [4]  # all four arrived within the batching window
        for reply, blocks in replies:
            assert reply.backend == "shm"
            assert reply.checksum == _file_checksum(path, pool, blocks)  # what the writer hashed is in the file
            assert reply.checksum != _file_checksum(path, pool, [b + 1 for b in blocks])
        assert engine.block_manager.num_free_blocks == 64  # the prefill worker kept nothing
    finally:
        path.unlink()
        server.stop()
        worker.stop()


@contextmanager
def _slow_prefill_and_decode(name: str, max_wait_ms: float, prefill_timeout_s: float, prefill_redis: bool):
    """A Redis, one registered prefill worker that holds each batch open for ``max_wait_ms`` (with Redis to end
    its leases in only when ``prefill_redis``), and a decode worker with a shared pool that finds it there.
    Yields (redis url, prefill worker, its server, its engine, decode worker, its engine, decode address)."""
    with EmbeddedRedis() as redis:
        registry = Registry(redis.url, security=TEST_SECURITY, ttl_s=30)
        prefill_engine = LLMEngine(model="default", num_blocks=64, block_size=16)
        prefill, prefill_server, prefill_address = _serve_prefill(prefill_engine, max_wait_ms,
                                                                  registry if prefill_redis else None)  # fmt: skip
        registry.register(WorkerInfo(worker_id="prefill-b", role="prefill", address=prefill_address,
                                     fingerprint=prefill.fingerprint))  # fmt: skip
        engine = LLMEngine(model="default", num_blocks=32, block_size=16, shared_kv_name=name)
        aio = AsyncioThread()
        decode = DecodeWorker(engine, name, "127.0.0.1:0", aio, TEST_SECURITY,
                              Registry(redis.url, security=TEST_SECURITY), prefill_timeout_s=prefill_timeout_s,
                              prefill_ms_per_token=0, shm_path=str(engine.runner.kv_pool_path))  # fmt: skip
        decode.loop.start()
        server = InProcessServer({"Decode": decode}, aio=aio)
        try:
            # until its first refresh of the registry, the decode worker knows no prefill worker and prefills
            # locally: no lease, nothing for these tests to watch (the refresher is slow on a loaded machine)
            wait_until(lambda: decode.prefills.workers, 10, "the decode worker seeing the prefill worker")
            yield redis.url, prefill, prefill_server, prefill_engine, decode, engine, server.address
        finally:
            server.stop()
            decode.stop()
            aio.stop()
            prefill_server.stop()
            prefill.stop()
            engine.close()
            registry.stop()


def _generate(address: str, request_id: str, prompt: list[int], max_tokens: int):
    """A streaming Generate call to a decode worker (iterate it for the messages, or cancel it)."""
    sampling = pb.SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.DecodeStub(channel).Generate(request, timeout=120, metadata=TEST_SECURITY.metadata())


@pytest.mark.slow
def test_expired_lease_quarantines_blocks_and_the_request_completes(engine_prompts, hf_greedy):
    # the prefill worker holds each batch open for 4 s, longer than the decode worker waits for a prefill
    with _slow_prefill_and_decode("decode-l", 4000, 1.0, False) as (_, prefill, _, prefill_engine, decode, engine,
                                                                    address):  # fmt: skip
        channel, call = _generate(address, "lease", engine_prompts[5], 32)
        with channel:
            messages = list(call)
        assert [t for m in messages for t in m.token_ids] == hf_greedy[5]
        assert messages[-1].transfer_backend == "local"  # the lease expired, so it was prefilled here
        assert decode.quarantine.num_held == 1  # its first blocks were held back, not reused at once
        # the slow batch window closes: the abandoned job must be dropped there, not run
        wait_until(lambda: prefill.num_cancelled == 1, 10, "the expired job dropped when its batch window closed")
        prefill_pool = prefill_engine.block_manager
        wait_until(lambda: prefill_pool.num_free_blocks == prefill_pool.num_blocks, 5, "the dropped job's blocks freed")
        assert prefill.batch_sizes == [1]
        pool = engine.block_manager  # the late writer finishes; the quarantine ends after the timeout
        wait_until(lambda: pool.num_free_blocks == pool.num_blocks, 10, "quarantined blocks were never freed")


@pytest.mark.slow
def test_blocks_of_an_abandoned_prefill_are_freed_when_the_writer_ends_its_lease(engine_prompts):
    """A client gives up while its prompt waits in a prefill worker's batch: the decode worker holds the blocks
    back (the writer may still touch them) until the writer ends its lease in Redis, long before the lease's
    60 s run out."""
    with _slow_prefill_and_decode("decode-q", 1500, 60.0, True) as (url, prefill, _, _, decode, engine, address):
        channel, call = _generate(address, "gone", engine_prompts[5], 8)
        with channel:
            wait_until(lambda: registry_has_lease(url), 20, "the prefill was never leased")
            call.cancel()
        wait_until(lambda: decode.quarantine.num_held == 1, 20, "the abandoned blocks were not held back")
        pool = engine.block_manager
        wait_until(lambda: pool.num_free_blocks == pool.num_blocks, 15, "held blocks were not freed when the writer "
              "ended its lease")  # fmt: skip
        assert decode.quarantine.num_freed_early == 1  # by the writer's word, not by the 60 s deadline
        assert prefill.num_cancelled == 1
        wait_until(lambda: not registry_has_lease(url), 5, "the ended lease was left in Redis")  # the holder deleted it


@pytest.mark.slow
def test_blocks_held_for_a_vanished_writer_are_freed_when_nothing_listens_at_its_address(engine_prompts, hf_greedy):
    """The prefill worker goes away mid-prefill and nobody ends its lease (it has no Redis here): once its
    port refuses connections the decode worker frees the held blocks, long before the lease's 60 s end, and
    the request is prefilled locally."""
    with _slow_prefill_and_decode("decode-v", 3000, 60.0, False) as (url, _, prefill_server, _, decode, engine,
                                                                     address):  # fmt: skip
        channel, call = _generate(address, "vanish", engine_prompts[5], 32)
        with channel:
            wait_until(lambda: registry_has_lease(url), 20, "the prefill was never leased")
            prefill_server.stop()  # the port closes while the prompt waits in the batch window
            messages = list(call)
        assert [t for m in messages for t in m.token_ids] == hf_greedy[5]
        assert messages[-1].transfer_backend == "local"
        pool = engine.block_manager
        wait_until(lambda: pool.num_free_blocks == pool.num_blocks, 15, "held blocks were not freed after the writer "
              "vanished")  # fmt: skip
        assert decode.quarantine.num_held == 1 and decode.quarantine.num_freed_early == 1


def registry_has_lease(url: str) -> bool:
    import redis as redis_client

    with redis_client.Redis.from_url(url) as raw:
        return bool(raw.keys("kvserve:lease:*"))
