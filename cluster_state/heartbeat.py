"""The thread that keeps one worker registered, and puts it back after Redis lost it.

Every ``interval_s`` it calls ``beat()``, which sends the worker's current load (``Registry.heartbeat`` with
``HEARTBEAT_SCRIPT``) and refreshes its TTL. Two events call for a resync:

* Redis no longer knows the worker (its hash expired during an outage, or Redis restarted empty): the thread
  registers the full description again, with the latest load (``register_again()``);
* Redis came back from an outage (``RedisLink.num_recoveries`` moved): writes made meanwhile were dropped.

In both cases it then calls the worker's ``on_resync()`` (from this thread), where the worker republishes what
Redis may have lost: its live leases and its prefix blocks. A resync that fails (Redis went away again,
``on_resync`` raised) is retried on the next beat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cluster_state.redis_link import RedisLink

logger = logging.getLogger(__name__)

# One beat: rewrite a worker's load fields (with their signature) and refresh its TTL only while its hash
# exists, so an expired worker is never resurrected as a partial hash holding load numbers alone. Re-adding
# the id to the set heals a reader's prune that raced with a re-registration.
# KEYS: worker hash, workers set. ARGV: ttl ms, worker id, field, value, ...
HEARTBEAT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""


class Heartbeat(threading.Thread):
    """A daemon thread beating for one worker until ``stop()``. ``beat()`` returns whether Redis knows the worker
    (None: no worker to beat for now); ``register_again()`` whether writing it whole again succeeded.

    Invariant: ``synced_recoveries`` is the number of Redis recoveries after which this worker has been fully
    resynchronized (registered and ``on_resync`` returned); a beat that sees more starts a resync.
    """

    def __init__(
        self,
        beat: Callable[[], bool | None],
        register_again: Callable[[], bool],
        link: RedisLink,
        on_resync: Callable[[], None] | None,
        interval_s: float,
        name: str,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._send_beat, self._register_again, self._link = beat, register_again, link
        self._on_resync = on_resync
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.synced_recoveries = link.num_recoveries

    def run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self._beat()
            except Exception:  # a bad load or on_resync must not end the worker's liveness
                logger.exception("heartbeat failed; retrying in %.2f s", self._interval_s)

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def _beat(self) -> None:
        known = self._send_beat()
        if known is None:
            return
        recoveries = self._link.num_recoveries
        if self._link.down or (known and recoveries == self.synced_recoveries):
            return
        if not known and not self._register_again():
            return
        if self._on_resync is not None:
            self._on_resync()
        self.synced_recoveries = recoveries
