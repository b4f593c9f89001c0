"""A shared-memory KV pool is made only where it fits: a sparse pool file on a full tmpfs kills its worker with
SIGBUS on some later write (Docker gives a container 64 MiB of /dev/shm), so it falls back to private memory."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvstore import KVCacheSpec
from kvstore.transfer import SHM_DIR_ENV, create_shared_pool

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 64  # 32 KiB
POOL_BYTES = SPEC.total_bytes(NUM_BLOCKS)


@pytest.fixture
def pool_dir(tmp_path, monkeypatch):
    directory = tmp_path / "pools"
    monkeypatch.setenv(SHM_DIR_ENV, str(directory))
    return directory


def _free_space(monkeypatch, directory, free_bytes: int) -> None:
    """Make ``os.statvfs`` report ``free_bytes`` available on the filesystem of ``directory``."""
    real = os.statvfs

    def statvfs(path):
        result = real(path)
        if os.path.realpath(path) != os.path.realpath(directory):
            return result
        fields = list(result)
        fields[4] = free_bytes // result.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_a_pool_that_fits_lives_in_a_private_shared_memory_file(pool_dir, monkeypatch):
    _free_space(monkeypatch, pool_dir, 10 * POOL_BYTES)
    pool, path = create_shared_pool(SPEC, NUM_BLOCKS, "decode-fits")
    assert path is not None and path.parent == pool_dir
    assert path.stat().st_size == POOL_BYTES and path.stat().st_mode & 0o777 == 0o600


def test_a_pool_larger_than_the_free_space_falls_back_to_private_memory_with_a_warning(pool_dir, monkeypatch, caplog):
    _free_space(monkeypatch, pool_dir, POOL_BYTES // 2)
    with caplog.at_level(logging.WARNING, logger="kvstore.transfer"):
        pool, path = create_shared_pool(SPEC, NUM_BLOCKS, "decode-full")
    assert path is None
    assert list(pool_dir.iterdir()) == []  # no pool file for anyone to map
    pool.layers[1].v_cache[NUM_BLOCKS - 1].fill_(3.0)  # the whole pool is writable memory
    assert pool.layers[1].v_cache[NUM_BLOCKS - 1].sum().item() == 3.0 * SPEC.block_size * 2 * 8
    message = caplog.text
    assert "0.0 MiB free" in message and "private memory" in message  # the sizes, what happens
    assert f"the KV pool needs {POOL_BYTES / (1 << 20):,.1f} MiB" in message
    assert "shm_size" in message and "--no-shm" in message  # and the fixes


def test_space_that_other_pools_may_still_claim_does_not_count_as_free(pool_dir, monkeypatch, caplog):
    """Two pools that each fit the free space alone must not both be made: their pages come later."""
    _free_space(monkeypatch, pool_dir, POOL_BYTES + POOL_BYTES // 2)
    _, first = create_shared_pool(SPEC, NUM_BLOCKS, "decode-a")
    with caplog.at_level(logging.WARNING, logger="kvstore.transfer"):
        _, second = create_shared_pool(SPEC, NUM_BLOCKS, "decode-b")
    assert first is not None and second is None
    assert "promised to other KV pools" in caplog.text
