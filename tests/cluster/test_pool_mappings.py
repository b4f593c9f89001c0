"""A prefill worker unmaps a decode worker's KV pool once that worker is gone (``prefill_service.destinations``).
Every decode restart makes a new pool file (``kvstore.shared_pool.pool_file_name``); a dead worker's pool that
is still mapped keeps its whole size in memory even after the file is removed, so each restart would pin
another pool's worth."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from cluster_utils import cluster, supervised
from waiting import wait_until

from kvserve.client import Client
from kvserve.launcher.supervisor import RestartPolicy
from kvstore import KVCacheSpec
from kvstore.shared_pool import pool_file_name
from prefill_service.destinations import Destinations
from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import Security
from transfer.backend import Backend

POLICY = RestartPolicy(initial_delay_s=0.2, startup_timeout_s=120.0)
NUM_RESTARTS = 3
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 8


def mapped_pools(pid: int, shm_dir: Path) -> set[str]:
    """The files of ``shm_dir`` that process ``pid`` maps, as /proc shows them: a removed one ends in
    ' (deleted)'."""
    prefix = f"{shm_dir.resolve()}/"
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and fields[5].startswith(prefix):
            paths.add(fields[5])
    return paths


def _kill_and_await_restart(child) -> None:
    old_pid = child.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: child.pid != old_pid and child.answers(), 90, f"{child.name} restarted and answering")


def _prefill_into_the_pool(endpoint: str, index: int) -> None:
    """Send requests until one has its prompt's KV written by the prefill worker into the decode worker's pool
    (a decode worker that does not know the prefill worker yet prefills locally)."""
    with Client(endpoint, timeout_s=60) as client:
        backends = []
        while Backend.SHM not in backends:
            assert len(backends) < 100, f"no request went through the prefill worker: {backends}"
            backends.append(client.generate([7, 8, 9, 10 + index], max_tokens=2, ignore_eos=True).transfer_backend)
            time.sleep(0.1 if backends[-1] != Backend.SHM else 0)


@pytest.mark.soak  # ~25 s: pytest -m soak tests/cluster/test_pool_mappings.py (the unit tests below run in make test)
def test_a_prefill_worker_maps_only_the_live_pool_after_three_decode_restarts(tmp_path):
    c = cluster(1, 1, tmp_path)
    with supervised(c, POLICY):
        decode, prefill_pid = c.child("decode-0"), c.child("prefill-0").pid
        _prefill_into_the_pool(c.endpoint, 0)
        for restart in range(1, NUM_RESTARTS + 1):
            _kill_and_await_restart(decode)
            _prefill_into_the_pool(c.endpoint, restart)
        live = f"{(c.shm_dir / pool_file_name('decode-0', decode.pid)).resolve()}"
        deadline = time.monotonic() + 5  # the batcher looks for removed pool files once a second
        while (mapped := mapped_pools(prefill_pid, c.shm_dir)) != {live} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.child("prefill-0").pid == prefill_pid  # the same prefill worker saw every restart
    print(f"\nafter {NUM_RESTARTS} decode restarts the prefill worker maps {len(mapped)} pool files: {sorted(mapped)}")
    assert mapped == {live}


def _pool_file(directory: Path, pid: int) -> Path:
    """A decode worker's pool file, as ``create_shared_pool`` makes it (not mapped by this process)."""
    path = directory / pool_file_name("decode-0", pid)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SPEC.total_bytes(NUM_BLOCKS))
    os.close(fd)
    return path


def _destination(path: Path) -> pb.KVDestination:
    return pb.KVDestination(backend=Backend.SHM, shm_path=str(path), num_blocks=NUM_BLOCKS, worker_id="decode-0")


def test_a_removed_pool_is_unmapped_once_no_job_holds_it(tmp_path):
    """No request needs to come: the batcher's idle call closes it. A job still writing there keeps it."""
    destinations = Destinations(SPEC, "fp", "prefill-0", Security.insecure(), None, torch.device("cpu"))
    path = _pool_file(tmp_path, 1001)
    writing = destinations.open(_destination(path))  # what a job (and its engine sequence) holds
    assert mapped_pools(os.getpid(), tmp_path) == {str(path)}
    path.unlink()  # the decode worker died and the supervisor removed its pool file
    destinations.close_gone_pools()
    writing.pool.parts[0].layers[0].k_cache[0].fill_(1.0)  # the job's write still lands in the mapping
    assert mapped_pools(os.getpid(), tmp_path) == {f"{path} (deleted)"}
    del writing  # the job is done
    assert mapped_pools(os.getpid(), tmp_path) == set()
    destinations.close()


def test_a_newer_pool_of_the_same_decode_worker_closes_the_older_one(tmp_path):
    """A standalone decode worker's restart leaves its predecessor's file until something removes it."""
    destinations = Destinations(SPEC, "fp", "prefill-0", Security.insecure(), None, torch.device("cpu"))
    older, newer = _pool_file(tmp_path, 1001), _pool_file(tmp_path, 1002)
    assert destinations.open(_destination(older)) is destinations.open(_destination(older))  # opened once
    destinations.open(_destination(newer))
    assert mapped_pools(os.getpid(), tmp_path) == {str(newer)}
    destinations.close()
    assert mapped_pools(os.getpid(), tmp_path) == set()
