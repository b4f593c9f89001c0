"""The pool and Redis scratch directories of a ``kvserve up`` outlive a SIGKILLed launcher only until the next
start, on any port; a live cluster's directories and other users' are never removed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from waiting import wait_until

from kvserve.launcher.cluster import free_base_port
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.launcher.scratch import (
    REDIS_DIR_PREFIX,
    cluster_shm_dir,
    hold_dir,
    process_alive,
    remove_dead_clusters,
    remove_if_abandoned,
)
from kvstore.shared_pool import pool_file_name

REPO = Path(__file__).resolve().parents[2]

# What a launcher keeps on the host, made as ``start_cluster`` makes it: a held pool directory with a pool
# file in it, and an embedded Redis.
LAUNCHER = """
import os, sys, time
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.launcher.scratch import cluster_shm_dir, hold_dir
from kvstore.shared_pool import pool_file_name

pools = hold_dir(cluster_shm_dir(int(sys.argv[1])))
(pools.path / pool_file_name("decode-0", os.getpid())).write_bytes(b"kv")
redis = EmbeddedRedis()
print(pools.path, redis.data_dir, redis.pid, flush=True)
time.sleep(600)
"""


def _killed_launcher(port: int) -> tuple[Path, Path]:
    """Run a launcher of a cluster on ``port``, SIGKILL it; returns its pool and Redis directories."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(port)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)  # fmt: skip
    try:
        pools, redis_dir, redis_pid = launcher.stdout.readline().split()
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    wait_until(lambda: not process_alive(int(redis_pid)), 10, "the embedded Redis dying with its SIGKILLed launcher",
               interval_s=0.02)  # fmt: skip
    return Path(pools), Path(redis_dir)


def test_a_start_removes_every_dead_clusters_directories_and_keeps_live_ones():
    base = free_base_port()
    dead_port, live_port, old_live_port, empty_port = base, base + 1, base + 10, base + 30
    dead_pools, dead_redis = _killed_launcher(dead_port)
    assert dead_pools.is_dir() and dead_redis.is_dir()  # SIGKILL skipped the launcher's clean-up

    live_pools = hold_dir(cluster_shm_dir(live_port))  # a live cluster's, as start_cluster holds it
    (live_pools.path / pool_file_name("decode-0", os.getpid())).write_bytes(b"kv")
    old_live_pools = cluster_shm_dir(old_live_port)  # a live cluster of an older kvserve: it holds nothing
    old_live_pools.mkdir(mode=0o700)
    (old_live_pools / pool_file_name("decode-0", os.getpid())).write_bytes(b"kv")
    empty = cluster_shm_dir(empty_port)  # a launcher killed before it held its directory
    empty.mkdir(mode=0o700)
    try:
        with EmbeddedRedis() as live_redis:
            removed = remove_dead_clusters()  # what every start_cluster runs first, whatever its port
            assert {dead_pools, dead_redis, empty} <= set(removed)
            assert not dead_pools.exists() and not dead_redis.exists() and not empty.exists()
            assert {live_pools.path, old_live_pools, live_redis.data_dir}.isdisjoint(removed)
            assert live_pools.path.is_dir() and old_live_pools.is_dir()
            assert (live_redis.data_dir / "redis.conf").exists()
    finally:
        live_pools.release()
        shutil.rmtree(live_pools.path, ignore_errors=True)
        shutil.rmtree(old_live_pools, ignore_errors=True)


def test_a_directory_two_clusters_share_stays_until_both_let_go():
    path = cluster_shm_dir(free_base_port())
    first, second = hold_dir(path), hold_dir(path)  # two clusters on one port, on different host addresses
    assert path.stat().st_mode & 0o777 == 0o700
    first.release()
    assert not remove_if_abandoned(path) and path.is_dir()
    second.release()
    assert remove_if_abandoned(path) and not path.exists()


def test_hold_refuses_what_someone_planted_at_the_path(tmp_path):
    path = cluster_shm_dir(free_base_port())
    path.symlink_to(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="not a directory owned by this user"):
            hold_dir(path)
        assert not remove_if_abandoned(path) and path.is_symlink() and tmp_path.is_dir()
    finally:
        path.unlink()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's directories needs root")
def test_another_users_directories_are_never_removed():
    other_uid = 4242
    pools = cluster_shm_dir(free_base_port())  # named as ours, but owned by someone else
    pools.mkdir(mode=0o700)
    redis_dir = Path(tempfile.mkdtemp(prefix=REDIS_DIR_PREFIX))
    for path in (pools, redis_dir):
        os.chown(path, other_uid, other_uid)
    try:
        removed = remove_dead_clusters()
        assert pools not in removed and redis_dir not in removed
        assert pools.is_dir() and redis_dir.is_dir()
        with pytest.raises(RuntimeError, match="not a directory owned by this user"):
            hold_dir(pools)
    finally:
        shutil.rmtree(pools)
        shutil.rmtree(redis_dir)
