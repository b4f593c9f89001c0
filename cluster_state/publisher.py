"""A worker's side of the Redis prefix index: its engine's block events, applied from a thread of their own.

The engine loop only hands events over (``publish``, a dict update under a lock, with the events
``LLMEngine.take_prefix_events`` netted since the last iteration); a daemon thread takes whatever piled up
every ``interval_s`` and applies it in one pipelined round trip, the last event per hash winning. A full
``resync`` (at start, so a worker restarted under the same id drops what its predecessor left; and when
Redis lost everything) first purges every entry naming this worker, then publishes the set the engine
holds now. Redis being down costs the events of the outage, which the next resync restores.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from cluster_state.prefix_index import TIERS, PrefixIndex

log = logging.getLogger(__name__)


class PrefixPublisher:
    def __init__(self, index: PrefixIndex, worker_id: str, held_now: Callable[[], dict[str, list[str]]],
                 interval_s: float = 0.05) -> None:  # fmt: skip
        """``held_now()`` returns every block hash the worker holds, by tier (``LLMEngine.held_block_hashes``);
        it is called on the publisher thread, so it must copy atomically (``list(dict)`` of str keys does)."""
        self.index = index
        self.worker_id = worker_id
        self.held_now = held_now
        self.interval_s = interval_s
        self._pending: dict[tuple[str, str], bool] = {}  # (tier, hash) -> held, last event last
        self._resync = True  # a worker starts by dropping whatever an earlier process of its id left behind
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefix-publisher", daemon=True)
        self._thread.start()

    def publish(self, stored: Iterable[str], evicted: Iterable[str], tier: str = "device") -> None:
        """Queue block events of one tier (from the engine loop: never waits on Redis)."""
        if not stored and not evicted:
            return
        with self._lock:
            for held, hashes in ((False, evicted), (True, stored)):
                for block_hash in hashes:
                    self._pending.pop((tier, block_hash), None)
                    self._pending[(tier, block_hash)] = held

    def resync(self) -> None:
        """Republish the whole held set on the next round (e.g. Redis came back empty)."""
        with self._lock:
            self._resync = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                resync, self._resync = self._resync, False
                events, self._pending = self._pending, {}
            try:
                if resync:  # the held set now is newer than any event queued before it
                    self.index.purge_worker(self.worker_id)
                    events = {(tier, h): True for tier, hashes in self.held_now().items() for h in hashes}
                for tier in TIERS:
                    self.index.apply(self.worker_id, {h: held for (t, h), held in events.items() if t == tier}, tier)
            except Exception:  # noqa: BLE001 - the index is a hint; the next resync repairs it
                log.exception("publishing prefix events failed")
