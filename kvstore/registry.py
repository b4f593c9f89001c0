"""The cluster registry in Redis: live workers, in-flight KV leases and the prefix-block index.

Keys (namespace ``kvserve:``):

* ``kvserve:workers`` — set of registered worker ids; it may still name dead workers, readers prune them;
* ``kvserve:worker:{id}`` — hash describing one worker, expiring ``ttl_s`` after its last heartbeat;
* ``kvserve:lease:{request_id}`` — hash for one in-flight transfer (decode, prefill, block ids, state), with a TTL;
* ``kvserve:prefix:{block_hash}`` — set of ids of the workers that hold that full block.

Life of a worker here: ``register(info)`` writes its hash and adds it to the set; ``start_heartbeat`` refreshes
its load and TTL every ``ttl_s / 3``; when the heartbeat finds the hash gone (it expired, or Redis restarted
empty) it registers the full description again; ``stop()`` ends the thread and deregisters. A worker that dies
without ``stop()`` vanishes from ``workers()`` within ``ttl_s``.

Redis is advisory: no request may depend on it. Every method turns a connection error or timeout into an empty
answer (``[]``, ``{}``, ``None`` or ``False``) and logs one warning per outage; a short socket timeout bounds how
long a hung Redis can hold a caller (about two timeouts: the call and one reconnect).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.workers import LEASE_STATES, LOAD_FIELDS, Lease, Role, WorkerInfo, check_load

logger = logging.getLogger(__name__)


WORKERS_KEY = "kvserve:workers"
_T = TypeVar("_T")

# Heartbeat: refresh a worker's load fields and TTL only while its hash exists, so an expired worker is never
# resurrected as a partial hash holding load numbers alone. Re-adding the id to the set heals a reader's prune
# that raced with a re-registration. KEYS: worker hash, workers set. ARGV: ttl ms, worker id, field, value, ...
_HEARTBEAT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

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


def _prefix_key(block_hash: str) -> str:
    return f"kvserve:prefix:{block_hash}"


class Registry:
    """A client of the cluster registry; it speaks for at most one worker, the one last passed to ``register``.

    Invariants:
    * a worker hash in Redis always holds every ``WorkerInfo`` field (written whole by ``register``, only
      updated in place by ``heartbeat``) and expires ``ttl_s`` after the last register or heartbeat;
    * ``workers()`` returns only workers whose hash exists, and removes dead ids from the set as it reads;
    * no method raises on a Redis outage; ``redis_down`` is true from the first failed call until the next
      successful one, and each outage logs one warning.
    """

    def __init__(self, redis_url: str, ttl_s: float = 5.0, socket_timeout_s: float = 0.5) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        # One quick retry without backoff: it reconnects a pooled socket that a Redis restart left dead.
        self._redis = redis.Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._heartbeat_script = self._redis.register_script(_HEARTBEAT_SCRIPT)
        self._update_if_exists = self._redis.register_script(_UPDATE_IF_EXISTS_SCRIPT)
        self._state_lock = threading.Lock()
        self._redis_down = False
        self._own: WorkerInfo | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()

    @property
    def redis_down(self) -> bool:
        """True while the last Redis call failed: routing should fall back to load-only decisions."""
        return self._redis_down

    # ---- workers -------------------------------------------------------------------------------------------

    def register(self, info: WorkerInfo) -> bool:
        """Write ``info`` whole (replacing any old hash), start its TTL and remember it as this registry's worker."""
        with self._state_lock:
            self._own = info
        key = _worker_key(info.worker_id)

        def write() -> bool:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping=info.to_redis())
            pipe.pexpire(key, self._ttl_ms(self.ttl_s))
            pipe.sadd(WORKERS_KEY, info.worker_id)
            pipe.execute()
            return True

        return self._call("register", write, False)

    def heartbeat(self, worker_id: str, **load_fields: int) -> bool:
        """Update load fields (any of ``LOAD_FIELDS``) and refresh the TTL of a live worker.

        Returns False when Redis does not know the worker (expired or Redis restarted) or is down; the caller
        then registers it again. Raises ``ValueError`` for an unknown or negative load field.
        """
        unknown = set(load_fields) - set(LOAD_FIELDS)
        if unknown:
            raise ValueError(f"unknown load fields {sorted(unknown)}; expected some of {LOAD_FIELDS}")
        check_load(load_fields)
        with self._state_lock:
            if self._own is not None and self._own.worker_id == worker_id:
                self._own = dataclasses.replace(self._own, **load_fields)
        args: list[Any] = [self._ttl_ms(self.ttl_s), worker_id]
        for name, value in load_fields.items():
            args += [name, value]
        keys = [_worker_key(worker_id), WORKERS_KEY]
        return self._call("heartbeat", lambda: bool(self._heartbeat_script(keys=keys, args=args)), False)

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

        self._call("deregister", delete, None)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live workers (of ``role`` when given), sorted by id; ``[]`` when Redis is down."""

        def read() -> list[WorkerInfo]:
            ids = sorted(self._redis.smembers(WORKERS_KEY))
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(_worker_key(worker_id))
            hashes = pipe.execute()
            dead = [worker_id for worker_id, fields in zip(ids, hashes, strict=True) if not fields]
            if dead:
                self._redis.srem(WORKERS_KEY, *dead)
            live = []
            for fields in hashes:
                if not fields:
                    continue
                try:
                    live.append(WorkerInfo.from_redis(fields))
                except (KeyError, ValueError) as exc:
                    logger.warning("skipping malformed worker hash %r: %s", fields.get("worker_id"), exc)
            return live

        live = self._call("workers", read, [])
        return [w for w in live if role is None or w.role == role]

    # ---- heartbeat thread ----------------------------------------------------------------------------------

    def start_heartbeat(self, info_fn: Callable[[], Mapping[str, int]], interval_s: float | None = None) -> None:
        """Heartbeat this registry's worker from a daemon thread every ``interval_s`` (default ``ttl_s / 3``).

        ``info_fn()`` returns the current load fields. When Redis has lost the worker the thread registers its
        full description again (with the latest load), so a restarted Redis relearns it within one interval.
        """
        interval_s = self.ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval_s < self.ttl_s:
            raise ValueError(f"interval_s must be in (0, ttl_s={self.ttl_s}), got {interval_s}")
        if self._own is None:
            raise ValueError("register() a worker before start_heartbeat()")
        if self._heartbeat_thread is not None:
            raise RuntimeError("the heartbeat thread is already running")
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(info_fn, interval_s, self._heartbeat_stop),
            name=f"kvserve-heartbeat-{self._own.worker_id}",
            daemon=True,
        )
        self._heartbeat_thread.start()

    def stop(self) -> None:
        """Stop the heartbeat thread, deregister this registry's worker and close the connections. Idempotent."""
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
            self._heartbeat_thread = None
        if self._own is not None:
            self.deregister(self._own.worker_id)
        self._redis.close()

    def _heartbeat_loop(
        self, info_fn: Callable[[], Mapping[str, int]], interval_s: float, stop: threading.Event
    ) -> None:
        while not stop.wait(interval_s):
            try:
                self._beat(info_fn)
            except Exception:  # a bad info_fn must not end the worker's liveness
                logger.exception("heartbeat failed; retrying in %.2f s", interval_s)

    def _beat(self, info_fn: Callable[[], Mapping[str, int]]) -> None:
        own = self._own
        if own is None:
            return
        if self.heartbeat(own.worker_id, **info_fn()) or self._redis_down:
            return
        own = self._own  # heartbeat() folded the new load into it
        if own is not None:
            logger.info("Redis lost worker %s; registering it again", own.worker_id)
            self.register(own)

    # ---- leases --------------------------------------------------------------------------------------------

    def put_lease(
        self, request_id: str, decode_id: str, prefill_id: str, block_ids: Sequence[int], ttl_s: float
    ) -> bool:
        """Record (or replace) the lease for ``request_id`` in state ``pending``, expiring after ``ttl_s``."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        key = _lease_key(request_id)
        fields = {
            "decode_id": decode_id,
            "prefill_id": prefill_id,
            "block_ids": json.dumps([int(b) for b in block_ids]),
            "state": "pending",
        }

        def write() -> bool:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self._ttl_ms(ttl_s))
            pipe.execute()
            return True

        return self._call("put_lease", write, False)

    def get_lease(self, request_id: str) -> Lease | None:
        """The lease, or None when it expired, was deleted, never existed, or Redis is down."""
        fields = self._call("get_lease", lambda: self._redis.hgetall(_lease_key(request_id)), {})
        if not fields:
            return None
        return Lease(
            request_id=request_id,
            decode_id=fields["decode_id"],
            prefill_id=fields["prefill_id"],
            block_ids=json.loads(fields["block_ids"]),
            state=fields["state"],
        )

    def update_lease_state(self, request_id: str, state: str) -> bool:
        """Set the state of a live lease, keeping its TTL; False when the lease is gone (or Redis is down)."""
        if state not in LEASE_STATES:
            raise ValueError(f"lease state must be one of {LEASE_STATES}, got {state!r}")
        key = _lease_key(request_id)

        def update() -> bool:
            return bool(self._update_if_exists(keys=[key], args=["state", state]))

        return self._call("update_lease_state", update, False)

    def delete_lease(self, request_id: str) -> None:
        self._call("delete_lease", lambda: self._redis.delete(_lease_key(request_id)), None)

    # ---- prefix index --------------------------------------------------------------------------------------

    def add_prefix_blocks(self, worker_id: str, hashes: Iterable[str]) -> None:
        """Record that ``worker_id`` holds the full blocks with these chained hashes."""
        self._update_prefix_sets("add_prefix_blocks", worker_id, hashes, add=True)

    def remove_prefix_blocks(self, worker_id: str, hashes: Iterable[str]) -> None:
        """Record that ``worker_id`` evicted these blocks (Redis deletes a set once it is empty)."""
        self._update_prefix_sets("remove_prefix_blocks", worker_id, hashes, add=False)

    def prefix_owners(self, hashes: Sequence[str]) -> dict[str, int]:
        """For each worker holding ``hashes[0]``: how many leading hashes of the chain it holds, up to its first miss.

        Entries of workers that died without removing their blocks stay until evicted; intersect the answer
        with ``workers()``. ``{}`` when Redis is down.
        """
        if not hashes:
            return {}

        def read() -> list[set[str]]:
            pipe = self._redis.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.smembers(_prefix_key(block_hash))
            return pipe.execute()

        holders_per_block = self._call("prefix_owners", read, [])
        counts: dict[str, int] = {}
        still_matching: set[str] | None = None
        for holders in holders_per_block:
            still_matching = set(holders) if still_matching is None else still_matching & holders
            if not still_matching:
                break
            for worker_id in still_matching:
                counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts

    def _update_prefix_sets(self, what: str, worker_id: str, hashes: Iterable[str], add: bool) -> None:
        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for block_hash in hashes:
                if add:
                    pipe.sadd(_prefix_key(block_hash), worker_id)
                else:
                    pipe.srem(_prefix_key(block_hash), worker_id)
            pipe.execute()

        self._call(what, write, None)

    # ---- outage handling -----------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], _T], default: _T) -> _T:
        """Run one Redis operation; on a connection error or timeout note the outage and return ``default``."""
        try:
            result = fn()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            with self._state_lock:
                first_failure, self._redis_down = not self._redis_down, True
            if first_failure:
                logger.warning("Redis unreachable (%s: %s); registry answers are empty until it is back", what, exc)
            return default
        if self._redis_down:
            with self._state_lock:
                recovered, self._redis_down = self._redis_down, False
            if recovered:
                logger.info("Redis reachable again")
        return result

    @staticmethod
    def _ttl_ms(ttl_s: float) -> int:
        return max(1, round(ttl_s * 1000))
