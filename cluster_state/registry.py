"""The cluster registry in Redis: live workers, in-flight KV leases and the prefix-block index.

Keys (namespace ``kvserve:``):

* ``kvserve:workers`` — set of registered worker ids; it may still name dead workers, readers prune them;
* ``kvserve:worker:{id}`` — hash describing one worker, expiring ``ttl_s`` after its last heartbeat;
* ``kvserve:lease:{request_id}`` — a ``LeaseRecord`` (cluster_state/lease.py: decode, prefill, block ids,
  state), with a TTL; its holder puts and deletes it (``put_lease``, ``delete_lease``), its writer ends it
  (``end_lease``) once it will never write again, so the holder may free held blocks early;
* ``kvserve:prefix:{block_hash}`` — set of ids of the workers that hold that full block
  (``registry.prefix_index``, cluster_state/prefix_index.py).

Life of a worker here: ``register(info)`` writes its hash and adds it to the set; ``start_heartbeat`` refreshes
its load and TTL every ``ttl_s / 3``; ``stop()`` ends the thread and deregisters. A worker that dies without
``stop()`` vanishes from ``workers()`` within ``ttl_s``.

Trust: worker hashes (their load apart) and leases are signed, under keys per purpose (cluster_state/workers.py,
cluster_state/lease.py) and readers drop records that do not verify, so a process that can write to Redis but
lacks the token can neither pose as a worker (and receive prompts) nor grant itself KV blocks. A worker's
load, rewritten by every heartbeat, is signed on its own; a reader ignores a load that does not verify
(cluster_state/worker_reader.py).

Redis is advisory: no request depends on it. Calls go through a ``RedisLink`` (cluster_state/redis_link.py):
during an outage they return at once, without waiting on a socket, with a fallback answer: ``workers()`` the
last view it read, the others an empty answer (``{}``, ``None`` or ``False``). When Redis comes back, the
heartbeat thread (cluster_state/heartbeat.py) registers this worker again if Redis lost it and calls the
worker's ``on_resync`` so that it republishes its leases and prefix blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cluster_state.heartbeat import HEARTBEAT_SCRIPT, Heartbeat
from cluster_state.lease import DELETE_IF_WRITER_SCRIPT, LeaseRecord, end_signature
from cluster_state.prefix_index import PrefixIndex
from cluster_state.redis_link import RedisLink
from cluster_state.worker_reader import WorkerReader
from cluster_state.workers import LOAD_FIELDS, Role, WorkerInfo, check_load

if TYPE_CHECKING:
    from security.auth import Security

logger = logging.getLogger(__name__)


WORKERS_KEY = "kvserve:workers"

# Update fields of a hash that still exists, keeping its TTL. KEYS: hash. ARGV: field, value, ...
_UPDATE_IF_EXISTS_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


def _worker_key(worker_id: str) -> str:
    return f"kvserve:worker:{worker_id}"


def _lease_key(request_id: str) -> str:
    return f"kvserve:lease:{request_id}"


class Registry:
    """A client of the cluster registry; it speaks for at most one worker, the one last passed to ``register``.

    Invariants:
    * a worker hash in Redis always holds every ``WorkerInfo`` field, a signature over ``SIGNED_FIELDS`` and
      one over the load (written whole by ``register``; ``heartbeat`` rewrites the load and its signature)
      and expires ``ttl_s`` after the last register or heartbeat;
    * ``workers()`` returns only workers whose hash exists and verifies (with a load that does not verify
      replaced, see ``WorkerReader``), removes dead ids from the set as it reads, and during an outage
      returns the last list it read;
    * no method raises on a Redis outage, and none waits on Redis while it backs off (see ``RedisLink``).

    ``security`` is required: it signs what this registry writes and verifies what it reads. With
    ``Security.insecure()`` the signatures only catch mistakes, not forgery.
    """

    def __init__(
        self, redis_url: str, *, security: Security, ttl_s: float = 5.0, socket_timeout_s: float = 0.5
    ) -> None:
        """Connect to ``redis_url``; ``ValueError`` when Redis refuses its credentials (an unreachable Redis is
        only an outage)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._security = security
        self._link = RedisLink(redis_url, socket_timeout_s)
        self._redis = self._link.client
        self.prefix_index = PrefixIndex(self._link)
        self._heartbeat_script = self._redis.register_script(HEARTBEAT_SCRIPT)
        self._update_if_exists = self._redis.register_script(_UPDATE_IF_EXISTS_SCRIPT)
        self._delete_if_holder = self._redis.register_script(DELETE_IF_WRITER_SCRIPT)
        self._state_lock = threading.Lock()
        self._own: WorkerInfo | None = None
        self._last_workers: list[WorkerInfo] = []
        self._reader = WorkerReader(security)
        self._heartbeat: Heartbeat | None = None

    @property
    def redis_down(self) -> bool:
        """True while Redis is unreachable: answers are the last-known view or empty."""
        return self._link.down

    # ---- workers -------------------------------------------------------------------------------------------

    def register(self, info: WorkerInfo) -> bool:
        """Write ``info`` whole and signed (replacing any old hash), start its TTL, remember it as our worker."""
        with self._state_lock:
            self._own = info
        fields = info.to_redis(self._security)
        return self._replace("register", _worker_key(info.worker_id), fields, self.ttl_s, info.worker_id)

    def heartbeat(self, worker_id: str, **load_fields: int) -> bool:
        """Update load fields (any of ``LOAD_FIELDS``) and refresh the TTL of this registry's worker; the whole
        load is written again with its signature, in one update.

        Returns False when ``worker_id`` is not the registered worker (we can sign no other's load), or Redis
        does not know it (expired or Redis restarted) or is down; the caller then registers it again. Raises
        ``ValueError`` for an unknown or negative load field.
        """
        unknown = set(load_fields) - set(LOAD_FIELDS)
        if unknown:
            raise ValueError(f"unknown load fields {sorted(unknown)}; expected some of {LOAD_FIELDS}")
        check_load(load_fields)
        with self._state_lock:
            if self._own is None or self._own.worker_id != worker_id:
                return False
            own = self._own = dataclasses.replace(self._own, **load_fields)
        args: list[Any] = [_ttl_ms(self.ttl_s), worker_id]
        for name, value in own.load_to_redis(self._security).items():
            args += [name, value]
        keys = [_worker_key(worker_id), WORKERS_KEY]
        return self._link.call("heartbeat", lambda: bool(self._heartbeat_script(keys=keys, args=args)), False)

    def deregister(self, worker_id: str) -> None:
        """Remove the worker now (instead of waiting for its TTL); forget it if it is this registry's worker."""
        with self._state_lock:
            if self._own is not None and self._own.worker_id == worker_id:
                self._own = None

        def delete() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(_worker_key(worker_id))
            pipe.srem(WORKERS_KEY, worker_id)
            pipe.execute()

        self._link.call("deregister", delete, None)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live, authenticated workers (of ``role`` when given), sorted by id; the last such list while Redis
        is down. Whether a listed worker still answers is the caller's to find out."""

        def read() -> list[WorkerInfo]:
            ids = sorted(self._redis.smembers(WORKERS_KEY))
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(_worker_key(worker_id))
            hashes = pipe.execute()
            dead = [worker_id for worker_id, fields in zip(ids, hashes, strict=True) if not fields]
            if dead and self._redis.srem(WORKERS_KEY, *dead):  # the first reader to notice a death cleans up
                for worker_id in dead:
                    self.prefix_index.purge_worker(worker_id)
            live = self._reader.read(dict(zip(ids, hashes, strict=True)))
            self._last_workers = live
            return live

        live = self._link.call("workers", read, self._last_workers)
        return [w for w in live if role is None or w.role == role]

    # ---- heartbeat thread ----------------------------------------------------------------------------------

    @property
    def own(self) -> WorkerInfo | None:
        """The worker this registry speaks for, with the load of its last heartbeat; None before ``register``."""
        return self._own

    def start_heartbeat(
        self,
        info_fn: Callable[[], Mapping[str, int]],
        interval_s: float | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        """Heartbeat this registry's worker from a daemon thread every ``interval_s`` (default ``ttl_s / 3``).

        ``info_fn()`` returns the current load fields. ``on_resync()``, when given, is called from that thread
        after Redis came back or lost the worker (see cluster_state/heartbeat.py): republish leases and prefix blocks
        there.
        """
        interval_s = self.ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval_s < self.ttl_s:
            raise ValueError(f"interval_s must be in (0, ttl_s={self.ttl_s}), got {interval_s}")
        if self._own is None:
            raise ValueError("register() a worker before start_heartbeat()")
        if self._heartbeat is not None:
            raise RuntimeError("the heartbeat thread is already running")
        name = f"kvserve-heartbeat-{self._own.worker_id}"
        beat = lambda: None if (own := self._own) is None else self.heartbeat(own.worker_id, **info_fn())  # noqa: E731
        self._heartbeat = Heartbeat(beat, self._register_own_again, self._link, on_resync, interval_s, name)
        self._heartbeat.start()

    def _register_own_again(self) -> bool:
        own = self._own  # heartbeat() folded the latest load into it
        if own is None:
            return False
        logger.info("Redis lost worker %s; registering it again", own.worker_id)
        return self.register(own)

    def stop(self) -> None:
        """Stop the heartbeat thread, deregister this registry's worker and close the connections. Idempotent."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._own is not None:
            self.deregister(self._own.worker_id)
        self._link.close()

    # ---- leases --------------------------------------------------------------------------------------------

    def put_lease(
        self, request_id: str, decode_id: str, prefill_id: str, block_ids: Sequence[int], ttl_s: float
    ) -> bool:
        """The holder ``decode_id`` records (or replaces) its lease for ``request_id``: ``pending``, for ``ttl_s``."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        fields = LeaseRecord(request_id, decode_id, prefill_id, list(block_ids)).to_redis(self._security)
        return self._replace("put_lease", _lease_key(request_id), fields, ttl_s)

    def get_lease(self, request_id: str) -> LeaseRecord | None:
        """The lease's record; None when it expired, was deleted, never existed, does not verify, or Redis is down."""
        fields = self._link.call("get_lease", lambda: self._redis.hgetall(_lease_key(request_id)), {})
        if not fields:
            return None
        try:
            return LeaseRecord.from_redis(request_id, fields, self._security)
        except (KeyError, ValueError) as exc:
            logger.warning("ignoring lease %r: %s", request_id, exc)
            return None

    def end_lease(self, request_id: str, prefill_id: str, state: str) -> bool:
        """The writer ``prefill_id`` will never write under this lease again: set its final ``state`` (one of
        ``FINAL_STATES``, signed), keeping the TTL. False when the lease is gone (or Redis is down)."""
        signature = end_signature(self._security, request_id, prefill_id, state)
        key = _lease_key(request_id)

        def update() -> bool:
            return bool(self._update_if_exists(keys=[key], args=["state", state, "state_signature", signature]))

        return self._link.call("end_lease", update, False)

    def end_leases_of(self, prefill_id: str) -> int:
        """A restarted ``prefill_id`` ends what its dead predecessor left pending (``failed``): a worker id names
        one live process, so nothing writes under those leases any more. Returns how many it ended."""

        def pending() -> list[str]:
            keys = list(self._redis.scan_iter(match=_lease_key("*"), count=1000))
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, "prefill_id", "state")
            return [key.removeprefix(_lease_key("")) for key, (holder, state) in zip(keys, pipe.execute(), strict=True)
                    if holder == prefill_id and state == "pending"]  # fmt: skip

        return sum(self.end_lease(rid, prefill_id, "failed") for rid in self._link.call("end_leases_of", pending, []))

    def _replace(self, what: str, key: str, fields: dict[str, str], ttl_s: float, worker_id: str | None = None) -> bool:
        """Write ``fields`` as the whole hash ``key`` (replacing an old one) with a TTL of ``ttl_s``, and add
        ``worker_id`` to the workers' set, in one transaction; False while Redis is down."""

        def write() -> bool:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, _ttl_ms(ttl_s))
            if worker_id is not None:
                pipe.sadd(WORKERS_KEY, worker_id)
            pipe.execute()
            return True

        return self._link.call(what, write, False)

    def delete_lease(self, request_id: str, prefill_id: str | None = None) -> None:
        """The holder deletes the lease's record; with ``prefill_id``, only while it names that writer (a retry
        may have replaced it)."""
        key = _lease_key(request_id)
        if prefill_id is None:
            self._link.call("delete_lease", lambda: self._redis.delete(key), None)
        else:
            self._link.call("delete_lease", lambda: self._delete_if_holder(keys=[key], args=[prefill_id]), None)


def _ttl_ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))
