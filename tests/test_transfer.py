"""KV transfer: shm writes land in the decode pool's own memory, gRPC chunks are checksummed, layouts must match."""

from __future__ import annotations

import grpc
import pytest
import torch
from service_utils import TEST_SECURITY, InProcessServer

from decode_service.worker import DecodeWorker
from engine import LLMEngine, SamplingParams
from kvstore import KVCache, KVCacheSpec
from kvstore.transfer import (
    checksum,
    checksum_blocks,
    chunked,
    create_shared_pool,
    fingerprint,
    open_shared_pool,
    read_blocks,
    write_blocks,
)
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread


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
    return LLMEngine(model="default", num_blocks=64, block_size=16)


def test_shm_prefill_writes_straight_into_the_decode_pool(prefill_engine, engine_prompts):
    spec = prefill_engine.runner.kv_spec
    decode_pool, path = create_shared_pool(spec, 48, "test-decode")
    try:
        mapped = open_shared_pool(spec, 48, path)  # the prefill worker's view of the decode worker's pool
        # no intermediate buffer: the views the attention layers store into are a mapping of the decode pool's file
        assert _mapped_file(mapped.layers[7].v_cache.data_ptr()) == str(path)
        prompt = engine_prompts[6]  # 170 tokens, 11 blocks
        dst_blocks = [47, 3, 20, 5, 9, 40, 11, 30, 2, 44, 17]
        before = checksum_blocks(decode_pool, dst_blocks)
        rid = prefill_engine.add_request(
            prompt,
            SamplingParams(temperature=0, max_tokens=1),
            kv_destination=(mapped.layers, dst_blocks),
            hold_blocks=True,
        )
        while prefill_engine.has_unfinished_requests():
            prefill_engine.step()
        src_blocks = prefill_engine.block_manager.block_table(rid)
        full_src_bytes = read_blocks(prefill_engine.runner.kv_cache, src_blocks[:10])  # the 10 full blocks
        prefill_engine.release(rid)
        # compare the tokens written (the last block's tail beyond the prompt is not part of the transfer)
        per_token = [slice(None, 170 % 16) if i == 10 else slice(None) for i in range(11)]
        for layer_src, layer_dst in zip(prefill_engine.runner.kv_cache.layers, decode_pool.layers, strict=True):
            for i, (s, d) in enumerate(zip(src_blocks, dst_blocks, strict=True)):
                assert torch.equal(layer_src.k_cache[s][per_token[i]], layer_dst.k_cache[d][per_token[i]])
                assert torch.equal(layer_src.v_cache[s][per_token[i]], layer_dst.v_cache[d][per_token[i]])
        assert checksum_blocks(decode_pool, dst_blocks) != before
        assert len(full_src_bytes) > 0 and full_src_bytes == read_blocks(decode_pool, dst_blocks[:10])
    finally:
        path.unlink()


def test_block_bytes_round_trip_exactly():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32,
                       kv_cache_dtype="int8_v")  # fmt: skip
    src, dst = KVCache(spec, 10, "cpu"), KVCache(spec, 6, "cpu")
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8))
    data = read_blocks(src, [7, 2, 9])
    write_blocks(dst, [0, 5, 3], data)
    assert read_blocks(dst, [0, 5, 3]) == data
    assert checksum_blocks(dst, [0, 5, 3]) == checksum_blocks(src, [7, 2, 9]) == checksum(data)
    many_src, many_dst = list(range(10)) * 2, [0, 1, 2, 3, 4, 5] * 3 + [0, 1]  # 20 blocks: two chunks
    assert checksum_blocks(src, many_src) == checksum(b"".join(read_blocks(src, c) for c in chunked(many_src)))
    assert checksum_blocks(src, many_src) != checksum_blocks(dst, many_dst)
    with pytest.raises(ValueError, match="KV chunk holds"):
        write_blocks(dst, [1], data)


def test_fingerprint_depends_on_layout():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    other = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype=torch.float32)
    assert fingerprint("LlamaForCausalLM", spec) != fingerprint("LlamaForCausalLM", other)
    assert fingerprint("LlamaForCausalLM", spec) != fingerprint("Qwen2ForCausalLM", spec)


@pytest.fixture(scope="module")
def decode_server(prefill_engine):
    engine = LLMEngine(model="default", num_blocks=32, block_size=16)
    aio = AsyncioThread()
    worker = DecodeWorker(engine, "decode-t", "127.0.0.1:0", aio, TEST_SECURITY)
    worker.loop.start()
    prefill = PrefillWorker(prefill_engine, "prefill-t", "", TEST_SECURITY)
    prefill.loop.start()
    server = InProcessServer({"KVTransfer": worker.receiver, "Prefill": prefill}, aio=aio)
    yield server.address, worker, prefill
    server.stop()
    worker.stop()
    prefill.stop()
    aio.stop()


def test_corrupted_chunk_is_rejected(decode_server):
    address, worker, _ = decode_server
    data = bytes(10)
    chunk = pb.KVChunk(request_id="r", fingerprint=worker.fingerprint, block_ids=[0], data=data,
                       checksum=checksum(data + b"x"))  # fmt: skip
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVTransferStub(channel).PushKV(iter([chunk]), timeout=10, metadata=TEST_SECURITY.metadata())
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "fails its checksum" in err.value.details()


def test_mismatched_fingerprints_are_refused(decode_server):
    address, _, _ = decode_server
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            chunk = pb.KVChunk(request_id="r", fingerprint="not-ours", block_ids=[0], data=b"", checksum=checksum(b""))
            pb_grpc.KVTransferStub(channel).PushKV(iter([chunk]), timeout=10, metadata=TEST_SECURITY.metadata())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        request = pb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                    destination=pb.KVDestination(fingerprint="not-ours", backend="grpc",
                                                                 block_ids=[0]))  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillStub(channel).Prefill(request, timeout=10, metadata=TEST_SECURITY.metadata())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fingerprint" in err.value.details()
