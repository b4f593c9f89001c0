"""Which workers hold which full KV blocks, in which memory tier: sets in Redis, fed by block events.

``kvserve:prefix:{block_hash}`` names the workers holding a block in their device pool,
``kvserve:prefix:host:{block_hash}`` and ``kvserve:prefix:disk:{block_hash}`` those holding it in their host
and disk tiers (a block may be in several tiers of one worker at once). Each worker's engine reports the
blocks each tier stored and evicted, which ``PrefixPublisher`` applies (``apply``); the router asks
``holdings(chain)`` how long a prefix of a prompt's chained block hashes each worker holds, and in which tiers,
and weighs that against load. The index is a hint: a stale entry costs speed, never correctness (a decode worker
confirms a hit against its own token ids), so during a Redis outage writes are dropped and ``owners`` answers
``{}``; the worker republishes its whole block set when Redis comes back (``Registry.start_heartbeat``'s
``on_resync``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from cluster_state.redis_link import RedisLink

TIERS = ("device", "host", "disk")  # fastest first


def prefix_key(block_hash: str, tier: str = "device") -> str:
    return f"kvserve:prefix:{block_hash}" if tier == "device" else f"kvserve:prefix:{tier}:{block_hash}"


class Held(NamedTuple):
    """Leading blocks of a chain one worker holds, each counted in the fastest tier that holds it."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


class PrefixIndex:
    """Reads and writes the prefix sets through ``link`` (so they share its outage handling).

    Invariant: a set names a worker only while that worker last reported holding the block (Redis deletes a
    set once it is empty); workers that died without reporting stay listed until their blocks are removed.
    """

    def __init__(self, link: RedisLink) -> None:
        self._link = link

    def apply(self, worker_id: str, events: dict[str, bool], tier: str = "device") -> None:
        """Apply ``hash -> held`` events of one worker's ``tier`` in one pipelined round trip."""
        def write() -> None:
            pipe = self._link.client.pipeline(transaction=False)
            for block_hash, held in events.items():
                (pipe.sadd if held else pipe.srem)(prefix_key(block_hash, tier), worker_id)
            pipe.execute()

        if events:
            self._link.call("prefix_events", write, None)

    def purge_worker(self, worker_id: str) -> None:
        """Drop ``worker_id`` from every prefix set: it died, or it restarted with an empty cache. A scan of the
        index, so it runs only on such events, never per request."""
        def purge() -> None:
            client = self._link.client
            for keys in _batches(client.scan_iter(match=prefix_key("*"), count=1000), 1000):
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.srem(key, worker_id)
                pipe.execute()

        self._link.call("purge_prefix_entries", purge, None)

    def owners(self, hashes: Sequence[str]) -> dict[str, int]:
        """For each worker holding ``hashes[0]``: how many leading hashes of the chain it holds, up to its first miss.

        Intersect the answer with ``Registry.workers()`` to skip dead workers. ``{}`` when Redis is down.
        Counts the device tier only (see ``holdings`` for every tier).
        """
        if not hashes:
            return {}

        def read() -> list[set[str]]:
            pipe = self._link.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.smembers(prefix_key(block_hash))
            return pipe.execute()

        counts: dict[str, int] = {}
        still_matching: set[str] | None = None
        for holders in self._link.call("prefix_owners", read, []):
            still_matching = set(holders) if still_matching is None else still_matching & holders
            if not still_matching:
                break
            for worker_id in still_matching:
                counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts

    def holdings(self, hashes: Sequence[str]) -> dict[str, Held]:
        """For each worker holding ``hashes[0]`` in some tier: the leading hashes of the chain it holds in any
        tier, up to its first miss, each counted in the fastest tier holding it. One round trip; ``{}`` when
        Redis is down."""
        if not hashes:
            return {}

        def read() -> list[set[str]]:
            pipe = self._link.client.pipeline(transaction=False)
            for block_hash in hashes:
                for tier in TIERS:
                    pipe.smembers(prefix_key(block_hash, tier))
            return pipe.execute()

        replies = self._link.call("prefix_holdings", read, [])
        counts: dict[str, list[int]] = {}
        still_matching: set[str] | None = None
        for i in range(0, len(replies), len(TIERS)):
            by_tier = replies[i : i + len(TIERS)]
            holders = set().union(*by_tier)
            still_matching = holders if still_matching is None else still_matching & holders
            if not still_matching:
                break
            for worker_id in still_matching:
                tier = next(t for t, members in enumerate(by_tier) if worker_id in members)
                counts.setdefault(worker_id, [0] * len(TIERS))[tier] += 1
        return {worker_id: Held(*c) for worker_id, c in counts.items()}


def _batches(items: Iterable[str], size: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
