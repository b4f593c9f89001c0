"""The one transport interface: every transport hands the same bytes into the leased blocks and answers with
their checksum, however it moves them; a backend nobody serves is refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch
from service_utils import TEST_SECURITY, InProcessServer

from kvstore import KVCache, KVCacheSpec
from kvstore.shared_pool import SHM_DIR_ENV, create_shared_pool
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.blocks import checksum_blocks, read_blocks, write_blocks
from transfer.grpc_stream import KVReceiver
from transfer.interface import Origin, UnknownBackend
from transfer.registry import transport_class

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
ORIGIN = Origin(SPEC, "fp-test", "prefill-t", TEST_SECURITY)
NUM_BLOCKS = 40
SRC_BLOCKS, DST_BLOCKS = list(range(3, 23)), [39 - i for i in range(20)]  # 20 blocks: two grpc chunks


def _hand_off(transport, source: KVCache, run) -> str:
    """What the prefill worker does: the engine writes ``pool`` in place when there is one, then ``take``
    before our blocks are released, then ``finish`` on the event loop (``run``)."""
    if transport.pool is not None:
        write_blocks(transport.pool, DST_BLOCKS, read_blocks(source, SRC_BLOCKS))
    taken = transport.take(source, SRC_BLOCKS)
    return run(transport.finish("req-1", DST_BLOCKS, taken))


@pytest.fixture
def source() -> KVCache:
    pool = KVCache(SPEC, NUM_BLOCKS, "cpu")
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    return pool


def test_shm_and_grpc_hand_off_the_same_bytes(source, tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    expected = read_blocks(source, SRC_BLOCKS)

    decode_pool, path = create_shared_pool(SPEC, NUM_BLOCKS, "decode-t")
    dest = pb.KVDestination(backend="shm", worker_id="decode-t", shm_path=str(path), num_blocks=NUM_BLOCKS)
    shm = transport_class(dest.backend).open(dest, ORIGIN)
    assert _hand_off(shm, source, asyncio.run) == checksum_blocks(decode_pool, DST_BLOCKS)
    assert read_blocks(decode_pool, DST_BLOCKS) == expected  # in the decode worker's own memory
    shm.close()

    receiving = KVCache(SPEC, NUM_BLOCKS, "cpu")
    receiver = KVReceiver(receiving, ORIGIN.fingerprint, lambda request_id: (DST_BLOCKS, ORIGIN.worker_id))
    server = InProcessServer({"KVTransfer": receiver})
    try:
        dest = pb.KVDestination(backend="grpc", worker_id="decode-t", address=server.address)
        grpc_transport = transport_class(dest.backend).open(dest, ORIGIN)
        assert grpc_transport.pool is None  # nothing is written in place: the bytes go after the step
        assert _hand_off(grpc_transport, source, server.aio.run) == checksum_blocks(receiving, DST_BLOCKS)
        grpc_transport.close()
    finally:
        server.stop()
    assert read_blocks(receiving, DST_BLOCKS) == expected


def test_a_backend_nobody_serves_is_refused_by_name():
    with pytest.raises(UnknownBackend, match="'local' is not served here"):
        transport_class("local")
    assert transport_class("cuda_ipc").backend == "cuda_ipc"  # served; opening it needs a GPU
