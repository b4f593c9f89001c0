"""Which workers hold which full KV blocks: ``kvserve:prefix:{block_hash}`` sets in Redis, fed by block events.

Each worker's engine reports the blocks it stored and evicted, which ``PrefixPublisher`` applies (``apply``);
the router asks ``owners(chain)`` how long a prefix of a prompt's chained block hashes each worker holds and
weighs that against load. The index is a hint: a stale entry costs speed, never correctness (a decode worker
confirms a hit against its own token ids), so during a Redis outage writes are dropped and ``owners`` answers
``{}``; the worker republishes its whole block set when Redis comes back (``Registry.start_heartbeat``'s
``on_resync``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster_state.redis_link import RedisLink


def prefix_key(block_hash: str) -> str:
    return f"kvserve:prefix:{block_hash}"


class PrefixIndex:
    """Reads and writes the prefix sets through ``link`` (so they share its outage handling).

    Invariant: a set names a worker only while that worker last reported holding the block (Redis deletes a
    set once it is empty); workers that died without reporting stay listed until their blocks are removed.
    """

    def __init__(self, link: RedisLink) -> None:
        self._link = link

    def apply(self, worker_id: str, events: dict[str, bool]) -> None:
        """Apply ``hash -> held`` events of one worker in one pipelined round trip."""
        def write() -> None:
            pipe = self._link.client.pipeline(transaction=False)
            for block_hash, held in events.items():
                (pipe.sadd if held else pipe.srem)(prefix_key(block_hash), worker_id)
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


def _batches(items: Iterable[str], size: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
