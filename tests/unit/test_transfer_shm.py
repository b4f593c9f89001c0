"""The shm transport: a mapping of the decode worker's pool file, written in place, dropped once the file is
removed (its worker is gone)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from service_utils import TEST_SECURITY

from kvstore import KVCacheSpec
from kvstore.shared_pool import SHM_DIR_ENV, create_shared_pool, map_pool_file
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.blocks import checksum_blocks
from transfer.interface import Origin
from transfer.shm import ShmTransport

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
ORIGIN = Origin(SPEC, "fp-test", "prefill-t", TEST_SECURITY)


@pytest.fixture
def decode_pool(tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    return create_shared_pool(SPEC, 16, "decode-t")


def _destination(path, num_blocks: int = 16) -> pb.KVDestination:
    return pb.KVDestination(backend="shm", worker_id="decode-t", shm_path=str(path), num_blocks=num_blocks)


def test_writes_land_in_the_decode_workers_memory_and_finish_checksums_them(decode_pool):
    pool, path = decode_pool
    transport = ShmTransport.open(_destination(path), ORIGIN)
    transport.pool.parts[0].layers[1].v_cache[7].fill_(2.5)
    assert bool((pool.layers[1].v_cache[7] == 2.5).all())
    assert transport.take(transport.pool, [7]) is None  # nothing left to move after the step
    assert asyncio.run(transport.finish("r", [7, 3], None)) == checksum_blocks(pool, [7, 3])
    transport.close()


def test_a_removed_pool_file_means_its_decode_worker_is_gone(decode_pool):
    _, path = decode_pool
    transport = ShmTransport.open(_destination(path), ORIGIN)
    assert not transport.gone()
    path.unlink()
    assert transport.gone()
    transport.close()


def test_a_pool_of_another_size_is_refused_and_leaves_no_file_open(decode_pool):
    _, path = decode_pool
    open_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="layouts differ"):
        ShmTransport.open(_destination(path, num_blocks=15), ORIGIN)
    assert len(os.listdir("/proc/self/fd")) == open_fds
    with pytest.raises(ValueError, match="layouts differ"):
        map_pool_file(SPEC, 17, path)


def test_one_transport_per_pool_file():
    assert ShmTransport.key(_destination("/pools/a")) != ShmTransport.key(_destination("/pools/b"))
    assert ShmTransport.key(_destination("/pools/a")) == ShmTransport.key(_destination("/pools/a", num_blocks=3))
