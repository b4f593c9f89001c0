"""The Redis prefix index as workers feed it: batched events from a publisher thread, purged when a worker
dies (its heartbeat key expires) and when a worker of the same id starts again. A real Redis."""

from __future__ import annotations

import time

import pytest
from waiting import wait_until

from cluster_state.prefix_index import Held
from cluster_state.publisher import PrefixPublisher
from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo
from kvserve.launcher.redis_server import EmbeddedRedis
from security.auth import Security

SECURITY = Security(token="prefix-index-test")


@pytest.fixture
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def test_events_reach_the_index_and_a_dead_workers_entries_are_purged(redis_url):
    worker = Registry(redis_url, security=SECURITY, ttl_s=1.0)
    worker.register(WorkerInfo(worker_id="d0", role="decode", address="127.0.0.1:1"))
    held = ["h0", "h1", "h2"]
    publisher = PrefixPublisher(worker.prefix_index, "d0", lambda: {"device": list(held)})
    reader = Registry(redis_url, security=SECURITY)
    try:
        wait_until(lambda: reader.prefix_index.owners(held) == {"d0": 3})  # the start-up resync published the set
        publisher.publish(stored=["h3"], evicted=["h1"])
        wait_until(lambda: reader.prefix_index.owners(["h0", "h1"]) == {"d0": 1})
        assert reader.prefix_index.owners(["h3"]) == {"d0": 1}
        publisher.publish(stored=["h1"], evicted=[])  # the last event per hash wins
        publisher.publish(stored=[], evicted=["h1"])
        publisher.publish(stored=["h1"], evicted=[])
        wait_until(lambda: reader.prefix_index.owners(held) == {"d0": 3})
        # d0 dies: no deregistration, its key expires; the next reader of the registry purges its blocks
        publisher.stop()
        time.sleep(1.2)
        assert [w.worker_id for w in reader.workers()] == []
        assert reader.prefix_index.owners(held) == {} and reader.prefix_index.owners(["h3"]) == {}
    finally:
        publisher.stop()
        reader.stop()
        worker.stop()


def test_a_restarted_worker_starts_from_an_empty_entry_set(redis_url):
    first = Registry(redis_url, security=SECURITY)
    first.prefix_index.apply("d0", {"old0": True, "old1": True})  # what the previous process left behind
    first.prefix_index.apply("d1", {"old0": True})
    publisher = PrefixPublisher(first.prefix_index, "d0", lambda: {"device": ["new0"]})
    try:
        wait_until(lambda: first.prefix_index.owners(["new0"]) == {"d0": 1})
        assert first.prefix_index.owners(["old0", "old1"]) == {"d1": 1}  # d0's stale entries are gone, d1's stay
    finally:
        publisher.stop()
        first.stop()


def test_holdings_count_each_leading_block_in_the_fastest_tier_that_holds_it(redis_url):
    reg = Registry(redis_url, security=SECURITY)
    reg.register(WorkerInfo(worker_id="d0", role="decode", address="127.0.0.1:1"))
    index = reg.prefix_index
    chain = ["h0", "h1", "h2", "h3", "h4"]
    # a restarted d0 re-announces its disk tier through the resync; its host tier through events
    publisher = PrefixPublisher(index, "d0", lambda: {"device": ["h0"], "disk": ["h1", "h2", "h3"]})
    try:
        wait_until(lambda: index.holdings(chain) == {"d0": Held(device=1, disk=3)})
        publisher.publish(stored=["h2"], evicted=[], tier="host")  # loaded back from disk: host and disk now
        publisher.publish(stored=["h1"], evicted=[])  # ... and into the device pool
        wait_until(lambda: index.holdings(chain) == {"d0": Held(device=2, host=1, disk=1)})
        index.apply("d1", {"h0": True}, "host")
        index.apply("d1", {"h1": True, "h4": True})  # h2 missing: h4 is no prefix
        assert index.holdings(chain) == {"d0": Held(device=2, host=1, disk=1), "d1": Held(device=1, host=1)}
        assert index.owners(chain) == {"d0": 2} and index.holdings(chain)["d0"].total == 4
        index.purge_worker("d0")  # every tier's entries go
        assert index.holdings(chain) == {"d1": Held(device=1, host=1)}
    finally:
        publisher.stop()
        reg.stop()
