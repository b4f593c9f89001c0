"""The Redis registry against real redis-server processes on loopback: workers, prefix index, signatures,
credentials, and how it rides out a paused, killed or restarted Redis (leases: test_lease.py)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY
from waiting import wait_until

from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from kvserve.launcher.redis_server import EmbeddedRedis
from rpc import metrics
from security.auth import Security

SECURITY = Security(token="registry-test-token")


@pytest.fixture
def registry(redis_server: EmbeddedRedis, raw: redis.Redis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, security=SECURITY, ttl_s=5.0)
    yield reg
    reg.stop()


def _worker(worker_id: str, role: str = "decode", **fields) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{5000 + len(worker_id)}", **fields)


# ---- workers ---------------------------------------------------------------------------------------------------


def test_register_lists_every_field_and_deregister_removes(registry: Registry) -> None:
    d0 = _worker("d0", device="cuda:0", fingerprint="llama-16-fp16",
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
    new = _worker("d0", fingerprint="other")
    registry.register(new)  # replaces the whole description
    assert registry.workers() == [new, p0]


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
    with pytest.raises(ValueError, match="role"):
        WorkerInfo(worker_id="x", role="cache", address="h:1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo(worker_id="", role="decode", address="h:1")


def test_worker_without_heartbeat_disappears_after_ttl(redis_server: EmbeddedRedis, raw: redis.Redis) -> None:
    short = Registry(redis_server.url, security=SECURITY, ttl_s=1.0)
    short.register(_worker("d0"))
    assert [w.worker_id for w in short.workers()] == ["d0"]

    waited = wait_until(lambda: short.workers() == [], timeout_s=2.0)
    assert waited > 0.8  # it lived for its TTL, not less
    assert raw.smembers("kvserve:workers") == set()  # the reader pruned the dead id
    short.stop()


def test_heartbeat_thread_keeps_worker_alive_and_stop_removes_it(redis_server: EmbeddedRedis, raw: redis.Redis) -> None:
    reg = Registry(redis_server.url, security=SECURITY, ttl_s=0.5)
    with pytest.raises(ValueError, match="register"):
        reg.start_heartbeat(dict)
    reg.register(_worker("d0", total_blocks=100, free_blocks=100))
    with pytest.raises(ValueError, match="interval_s"):
        reg.start_heartbeat(dict, interval_s=reg.ttl_s)
    beats = iter(range(100, 0, -1))
    reg.start_heartbeat(lambda: {"free_blocks": next(beats)})

    deadline = time.monotonic() + 2.0  # four TTLs
    while time.monotonic() < deadline:
        assert [w.worker_id for w in reg.workers()] == ["d0"]
        time.sleep(0.1)
    [d0] = reg.workers()
    assert d0.free_blocks < 100 and d0.total_blocks == 100

    reg.stop()
    assert raw.smembers("kvserve:workers") == set()
    reg.stop()  # idempotent


# ---- the prefix index (its life with workers: test_prefix_index.py) ----------------------------------------------


def test_prefix_owners_counts_leading_blocks_only(registry: Registry) -> None:
    index = registry.prefix_index
    chain = ["h0", "h1", "h2", "h3", "h4"]
    index.apply("full", dict.fromkeys(chain, True))
    index.apply("gap", dict.fromkeys(["h0", "h1", "h3", "h4"], True))  # misses h2: only 2 leading blocks count
    index.apply("tail", dict.fromkeys(["h1", "h2", "h3"], True))  # lacks h0: holds no prefix at all

    assert index.owners(chain) == {"full": 5, "gap": 2}
    assert index.owners(chain[:1]) == {"full": 1, "gap": 1}
    assert index.owners(["other"] + chain) == {}
    assert index.owners([]) == {}

    index.apply("full", {"h3": False})
    assert index.owners(chain) == {"full": 3, "gap": 2}


# ---- trust -----------------------------------------------------------------------------------------------------


def test_entries_written_without_the_cluster_token_are_ignored(
    registry: Registry, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    registry.register(_worker("d0"))
    forged = {
        "evil": _worker("evil").to_redis(Security(token="a-guessed-token")),
        "bare": {k: v for k, v in _worker("bare").to_redis(SECURITY).items() if k != "signature"},
        "copy": raw.hgetall("kvserve:worker:d0"),  # a genuine signed entry filed under another id
    }
    for worker_id, fields in forged.items():
        raw.hset(f"kvserve:worker:{worker_id}", mapping=fields)
        raw.sadd("kvserve:workers", worker_id)

    with caplog.at_level(logging.WARNING, logger="cluster_state.registry"):
        for _ in range(3):
            assert [w.worker_id for w in registry.workers()] == ["d0"]
    assert sorted(r.getMessage().split("'")[1] for r in caplog.records) == ["bare", "copy", "evil"]  # once each

    raw.hset("kvserve:worker:d0", "address", "10.6.6.6:50051")  # redirect the genuine worker's prompts
    assert registry.workers() == []

    raw.delete("kvserve:workers")
    raw.set("kvserve:workers", "not a set")
    assert registry.workers() == [] and not registry.redis_down  # the last view it read


def test_credentials_come_from_the_url_and_a_wrong_password_is_a_clear_error() -> None:
    with EmbeddedRedis(password="s3cret pass") as server:
        assert server.url == f"redis://:s3cret%20pass@127.0.0.1:{server.port}/0"
        reg = Registry(server.url, security=SECURITY)
        assert reg.register(_worker("d0"))
        assert [w.worker_id for w in reg.workers()] == ["d0"]
        reg.stop()

        for url in (server.url.replace("s3cret%20pass", "guess"), f"redis://127.0.0.1:{server.port}/0"):
            with pytest.raises(ValueError, match="password or ACL user is wrong or missing") as refused:
                Registry(url, security=SECURITY)
            assert "guess" not in str(refused.value) and str(server.port) in str(refused.value)


# ---- Redis outages ---------------------------------------------------------------------------------------------


def test_paused_redis_answers_from_the_last_view_without_waiting_then_resyncs() -> None:
    with EmbeddedRedis() as server:
        reg = Registry(server.url, security=SECURITY, ttl_s=30.0, socket_timeout_s=0.25)
        reg.register(_worker("p0", role="prefill"))
        reg.register(_worker("d0"))
        resyncs: list[float] = []
        reg.start_heartbeat(dict, interval_s=0.1, on_resync=lambda: resyncs.append(time.monotonic()))
        known = reg.workers()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            for _ in range(100):
                assert reg.workers() == known
            # Without backoff each call would wait out a socket timeout and its retry: 100 x 0.5 s.
            assert time.monotonic() - start < 2.0
            assert reg.redis_down
            assert reg.workers("prefill") == known[1:]
            assert reg.get_lease("r") is None and reg.prefix_index.owners(["h0"]) == {}
        finally:
            os.kill(server.pid, signal.SIGCONT)

        other = Registry(server.url, security=SECURITY)
        other.register(_worker("d1"))
        wait_until(lambda: [w.worker_id for w in reg.workers()] == ["d0", "d1", "p0"], timeout_s=7.0)
        wait_until(lambda: len(resyncs) == 1, timeout_s=1.0)  # writes made during the pause need republishing
        other.stop()
        reg.stop()


def test_killed_redis_restarted_empty_relearns_the_worker_and_resyncs(caplog: pytest.LogCaptureFixture) -> None:
    server = EmbeddedRedis()
    reg = Registry(server.url, security=SECURITY, ttl_s=1.0)
    load = {"free_blocks": 8}
    resyncs: list[float] = []

    def resync() -> None:  # what a worker does: republish its blocks (and leases)
        reg.prefix_index.apply("d0", {"h0": True})
        resyncs.append(time.monotonic())

    try:
        reg.register(_worker("d0", fingerprint="fp", total_blocks=8, free_blocks=8))
        reg.start_heartbeat(lambda: dict(load), interval_s=0.1, on_resync=resync)
        known = reg.workers()
        os.kill(server.pid, signal.SIGKILL)
        wait_until(lambda: not server.alive, timeout_s=2.0)
        load["free_blocks"] = 5

        with caplog.at_level(logging.WARNING, logger="cluster_state"):
            calls = [
                (lambda: reg.workers(), known),
                (lambda: reg.heartbeat("d0", free_blocks=1), False),
                (lambda: reg.prefix_index.owners(["h0"]), {}),
                (lambda: reg.put_lease("r", "d0", "p0", [1], ttl_s=5), False),
                (lambda: reg.get_lease("r"), None),
                (lambda: reg.end_lease("r", "p0", "failed"), False),
        (lambda: reg.end_leases_of("p0"), 0),
                (lambda: reg.delete_lease("r"), None),
            ]
            for call, fallback in calls:
                assert call() == fallback
            time.sleep(0.3)  # a few failed heartbeats too
        assert reg.redis_down
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # one warning per outage
        assert resyncs == []

        server.restart()  # empty, on the same address
        wait_until(lambda: len(resyncs) == 1, timeout_s=7.0)
        [relearned] = reg.workers()
        assert (relearned.fingerprint, relearned.free_blocks, relearned.total_blocks) == ("fp", 5, 8)
        assert reg.prefix_index.owners(["h0"]) == {"d0": 1}
        assert not reg.redis_down
    finally:
        reg.stop()
        server.stop()


def test_registry_up_is_0_while_the_heartbeats_fail_and_1_once_redis_answers_again() -> None:
    """``kvserve_registry_up`` (the series of the KvserveRedisDown alert) reads the heartbeat's Redis link at scrape
    time: no Redis call of its own."""
    server = EmbeddedRedis()
    reg = Registry(server.url, security=SECURITY, ttl_s=1.0)
    metrics.export_registry_health("decode", reg)

    def scraped() -> float | None:
        return REGISTRY.get_sample_value("kvserve_registry_up", {"role": "decode"})

    try:
        reg.register(_worker("d0"))
        reg.start_heartbeat(dict, interval_s=0.1)
        assert scraped() == 1
        os.kill(server.pid, signal.SIGKILL)
        wait_until(lambda: scraped() == 0, timeout_s=2.0)  # the next heartbeat fails
        server.restart()
        wait_until(lambda: scraped() == 1, timeout_s=7.0)  # a probe after the backoff succeeds
    finally:
        reg.stop()
        server.stop()
