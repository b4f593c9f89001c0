"""This process's KV pool in a shared-memory file: made only where it fits (a sparse pool file on a full tmpfs
kills its worker with SIGBUS on some later write; Docker gives a container 64 MiB of /dev/shm), so it falls
back to private memory; named for its owner's pid, so a dead owner's file is found and removed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from kvstore import KVCacheSpec
from kvstore.shared_pool import SHM_DIR_ENV, create_shared_pool, pool_file_name, pool_file_pid, remove_stale_pools

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
    with caplog.at_level(logging.WARNING, logger="kvstore.shared_pool"):
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
    with caplog.at_level(logging.WARNING, logger="kvstore.shared_pool"):
        _, second = create_shared_pool(SPEC, NUM_BLOCKS, "decode-b")
    assert first is not None and second is None
    assert "promised to other KV pools" in caplog.text


def test_pool_files_of_dead_owners_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited: nobody holds its pid's pool any more
    live, stale = tmp_path / pool_file_name("decode-0", os.getpid()), tmp_path / pool_file_name("decode-0", dead_pid)
    other = tmp_path / "kvserve-notes-txt"
    for path in (live, stale, other):
        path.write_bytes(b"kv")
    assert pool_file_pid(live.name) == os.getpid() and pool_file_pid(other.name) is None
    assert remove_stale_pools(tmp_path) == [stale]
    assert sorted(tmp_path.iterdir()) == sorted([live, other])
