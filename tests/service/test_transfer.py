"""KV transfer end to end: a prefill engine's KV lands in the decode pool's own memory through the shm
transport, and a prefill worker refuses a destination whose layout differs from its own.

Each transport's own tests: tests/test_transfer_{backend,blocks,transport,shm,grpc_stream,cuda_ipc}.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from service_utils import TEST_SECURITY, InProcessServer

from engine import LLMEngine, SamplingParams
from kvstore.shared_pool import create_shared_pool
from prefill_service.handoff import Handoff, HandoffConnector
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from transfer.blocks import checksum_blocks, read_blocks
from transfer.interface import Origin
from transfer.shm import ShmTransport


def _mapped_file(address: int) -> str | None:
    """The file backing the mapping that contains ``address`` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[5] if len(parts) > 5 else None
    return None


@pytest.fixture(scope="module")
def prefill_engine():
    engine = LLMEngine(model="default", num_blocks=64, block_size=16)
    engine.connect(HandoffConnector(engine.runner.kv_pool, engine.config.block_size))
    return engine


def test_shm_prefill_writes_straight_into_the_decode_pool(prefill_engine, engine_prompts):
    spec = prefill_engine.runner.kv_spec
    decode_pool, path = create_shared_pool(spec, 48, "test-decode")
    try:
        dest = pb.KVDestination(backend="shm", worker_id="test-decode", shm_path=str(path), num_blocks=48)
        transport = ShmTransport.open(dest, Origin(spec, "fp", "prefill-t", TEST_SECURITY))
        # no intermediate buffer: the views the engine writes into are a mapping of the decode pool's file
        assert _mapped_file(transport.pool.parts[0].layers[7].v_cache.data_ptr()) == str(path)
        prompt = engine_prompts[6]  # 170 tokens, 11 blocks
        dst_blocks = [47, 3, 20, 5, 9, 40, 11, 30, 2, 44, 17]
        before = checksum_blocks(decode_pool, dst_blocks)
        rid = prefill_engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1),
                                         kv_params=Handoff(transport.pool, dst_blocks, 16))  # fmt: skip
        while prefill_engine.has_unfinished_requests():
            prefill_engine.step()
        src_blocks = prefill_engine.block_manager.block_table(rid)
        own = prefill_engine.runner.kv_cache
        full_src_bytes = read_blocks(own, src_blocks[:10])  # the 10 full blocks
        taken = transport.take(own, src_blocks)
        prefill_engine.release(rid)
        # compare the tokens written (the last block's tail beyond the prompt is not part of the transfer)
        per_token = [slice(None, 170 % 16) if i == 10 else slice(None) for i in range(11)]
        for layer_src, layer_dst in zip(own.layers, decode_pool.layers, strict=True):
            for i, (s, d) in enumerate(zip(src_blocks, dst_blocks, strict=True)):
                assert torch.equal(layer_src.k_cache[s][per_token[i]], layer_dst.k_cache[d][per_token[i]])
                assert torch.equal(layer_src.v_cache[s][per_token[i]], layer_dst.v_cache[d][per_token[i]])
        assert checksum_blocks(decode_pool, dst_blocks) != before
        assert len(full_src_bytes) > 0 and full_src_bytes == read_blocks(decode_pool, dst_blocks[:10])
        assert asyncio.run(transport.finish(rid, dst_blocks, taken)) == checksum_blocks(decode_pool, dst_blocks)
        transport.close()
    finally:
        path.unlink()


def test_a_prefill_worker_refuses_a_destination_of_another_layout(prefill_engine):
    prefill = PrefillWorker(prefill_engine, "prefill-t", "", TEST_SECURITY)
    prefill.loop.start()
    server = InProcessServer({"Prefill": prefill})
    try:
        request = pb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                    destination=pb.KVDestination(fingerprint="not-ours", backend="grpc",
                                                                 block_ids=[0]))  # fmt: skip
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillStub(channel).Prefill(request, timeout=10, metadata=TEST_SECURITY.metadata())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fingerprint" in err.value.details()
    finally:
        server.stop()
        prefill.stop()
