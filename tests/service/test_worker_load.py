"""A worker's load in the registry is signed: a load rewritten without the cluster token neither steers a
reader nor makes it drop the worker (cluster_state/worker_reader.py). A real Redis."""

from __future__ import annotations

import logging

from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from kvserve.launcher.redis_server import EmbeddedRedis
from security.auth import Security

SECURITY = Security(token="load-test-token")
KEY = "kvserve:worker:d0"


def _registry(redis_server: EmbeddedRedis) -> Registry:
    return Registry(redis_server.url, security=SECURITY, ttl_s=30.0)


def _load(info: WorkerInfo) -> tuple[int, int, int, int]:
    return info.free_blocks, info.total_blocks, info.num_running, info.num_waiting


def test_a_tampered_load_reads_as_the_last_verified_one_and_keeps_the_worker(redis_server, raw, caplog) -> None:
    worker, reader = _registry(redis_server), _registry(redis_server)
    worker.register(WorkerInfo("d0", "decode", "127.0.0.1:1", free_blocks=50, total_blocks=64))
    worker.heartbeat("d0", free_blocks=40, num_running=3, num_waiting=1)
    assert [_load(w) for w in reader.workers()] == [(40, 64, 3, 1)]

    with caplog.at_level(logging.WARNING, logger="cluster_state"):
        for forged in ({"num_running": "1000"}, {"num_running": "not a number"}, {"free_blocks": "-5"},
                       {"num_waiting": "0", "load_signature": "00" * 32}):  # fmt: skip
            raw.hset(KEY, mapping=forged)
            [d0] = reader.workers()  # neither dropped nor believed
            assert _load(d0) == (40, 64, 3, 1) and d0.address == "127.0.0.1:1"
    assert len([r for r in caplog.records if "does not verify" in r.getMessage()]) == 1  # once per worker life

    fresh = _registry(redis_server)  # it never saw a verified load of d0: it assumes none
    assert [_load(w) for w in fresh.workers()] == [(0, 0, 0, 0)]

    worker.heartbeat("d0", num_running=2)  # the next beat rewrites the whole load, signed
    assert [_load(w) for w in reader.workers()] == [(40, 64, 2, 1)]
    assert [_load(w) for w in fresh.workers()] == [(40, 64, 2, 1)]
    for registry in (worker, reader, fresh):
        registry.stop()


def test_a_load_signed_for_another_worker_or_life_does_not_verify(redis_server, raw) -> None:
    first = WorkerInfo("d0", "decode", "127.0.0.1:1", free_blocks=7, total_blocks=8, num_running=5)
    other = WorkerInfo("d1", "decode", "127.0.0.1:2", free_blocks=8, total_blocks=8)
    reader = _registry(redis_server)
    for info in (first, other):
        raw.hset(f"kvserve:worker:{info.worker_id}", mapping=info.to_redis(SECURITY))
        raw.sadd("kvserve:workers", info.worker_id)
    assert [_load(w) for w in reader.workers()] == [(7, 8, 5, 0), (8, 8, 0, 0)]

    raw.hset(KEY, mapping=other.load_to_redis(SECURITY))  # d1's genuine load, filed under d0
    assert [_load(w) for w in reader.workers()][0] == (7, 8, 5, 0)

    restarted = WorkerInfo("d0", "decode", "127.0.0.1:1", started_at=first.started_at + 1)
    raw.hset(KEY, mapping=restarted.to_redis(SECURITY) | first.load_to_redis(SECURITY))  # the last life's load
    assert [_load(w) for w in reader.workers()][0] == (0, 0, 0, 0)  # nothing verified of this life yet
    reader.stop()


def test_a_heartbeat_signs_only_for_its_own_worker_and_never_resurrects_it(redis_server, raw) -> None:
    worker = _registry(redis_server)
    worker.register(WorkerInfo("d0", "decode", "127.0.0.1:1"))
    assert not worker.heartbeat("d1", num_running=1)  # it holds no start time of d1 to sign with
    raw.delete(KEY)  # expired, or Redis restarted empty
    assert not worker.heartbeat("d0", num_running=1)
    assert not raw.exists(KEY)  # no partial hash holding a load alone
    assert worker.own is not None and worker.own.num_running == 1  # what it registers again
    worker.stop()
