"""One Redis connection for which an outage is a normal state: calls fall back at once while Redis is away.

The registry is advisory (no request may depend on Redis), so a failed call must cost its caller as little as
possible. ``RedisLink.call(what, fn, fallback)`` runs one Redis operation and, on a connection error or
timeout, returns ``fallback`` instead of raising; so does a data error (a key of the wrong type, written by
someone else), logged once. After a failure the link backs off: calls return their fallback without touching
the network until the retry time, then exactly one caller probes (runs its operation for real) while the
others keep falling back. The delay doubles from ``min_backoff_s`` to ``max_backoff_s`` for as long as the
probes fail and resets on the first success. A hung Redis (SIGSTOP, a full network buffer) therefore costs
one probe's socket timeouts per backoff period, not a timeout per call.

Credentials are a configuration matter, not an outage: everything about the connection (user, password,
database, ``rediss://`` for TLS and its query options) comes from the URL, and the constructor pings once and
raises ``ValueError`` when Redis refuses the credentials. An unreachable Redis at construction is just an
outage. If Redis refuses the credentials later (it was reconfigured under us) the link logs an error and
treats it as an outage, so the cluster keeps serving from its last-known view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_AUTH_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError)


class RedisLink:
    """A Redis client (``client``) plus the outage state shared by every call made through ``call``.

    Invariants:
    * ``down`` is true from a failed call until the next successful one; each outage logs one warning;
    * while ``down``, at most one call at a time touches Redis (the probe), and none before the retry time;
    * ``num_recoveries`` counts the outages that ended, so a caller can tell that Redis came back since it
      last looked (and may have lost writes made meanwhile).
    """

    def __init__(
        self, url: str, socket_timeout_s: float = 0.5, min_backoff_s: float = 0.1, max_backoff_s: float = 5.0
    ) -> None:
        if not 0 < min_backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < min_backoff_s <= max_backoff_s, got {min_backoff_s}, {max_backoff_s}")
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.where = redact(url)
        # The URL's options win over these keyword arguments (redis-py merges them on top), so nothing here
        # can override credentials or TLS. One quick retry without backoff reconnects a pooled socket that a
        # Redis restart left dead, so a restart alone does not look like an outage.
        self.client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._lock = threading.Lock()
        self._down = False
        self._probing = False
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.num_recoveries = 0
        self._reported: set[tuple[str, str]] = set()  # data errors already logged
        self._check_credentials()

    @property
    def down(self) -> bool:
        """True while the last Redis call failed: answers are fallbacks."""
        return self._down

    def call(self, what: str, fn: Callable[[], _T], fallback: _T) -> _T:
        """Run ``fn`` (one Redis operation, named ``what`` in logs); ``fallback`` when Redis is down or backing off."""
        with self._lock:
            if self._down:
                if self._probing or time.monotonic() < self._retry_at:
                    return fallback
                self._probing = True
        try:
            result = fn()
        except _AUTH_ERRORS as exc:
            logger.error("Redis at %s refused our credentials (%s: %s); check the Redis URL", self.where, what, exc)
            self._failed(what, exc)
            return fallback
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            self._failed(what, exc)
            return fallback
        except redis.exceptions.ResponseError as exc:  # Redis answered, but its data is not ours (a wrong type)
            self._succeeded()
            if (what, str(exc)) not in self._reported:
                self._reported.add((what, str(exc)))
                logger.error("Redis at %s refused %s: %s; answering without it", self.where, what, exc)
            return fallback
        except BaseException:
            with self._lock:
                self._probing = False
            raise
        self._succeeded()
        return result

    def close(self) -> None:
        self.client.close()

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            first_failure = not self._down
            self._down, self._probing = True, False
            self._backoff_s = self.min_backoff_s if first_failure else min(2 * self._backoff_s, self.max_backoff_s)
            self._retry_at = time.monotonic() + self._backoff_s
        if first_failure:
            logger.warning("Redis at %s unreachable (%s: %s); answering from fallbacks until it is back",
                           self.where, what, exc)  # fmt: skip

    def _succeeded(self) -> None:
        with self._lock:
            recovered = self._down
            self._down, self._probing = False, False
            if recovered:
                self.num_recoveries += 1
        if recovered:
            logger.info("Redis at %s reachable again", self.where)

    def _check_credentials(self) -> None:
        try:
            self.client.ping()
        except _AUTH_ERRORS as exc:
            self.client.close()
            raise ValueError(
                f"Redis at {self.where} refused the credentials of the Redis URL ({exc}): the password or ACL user "
                "is wrong or missing; give them as redis://user:password@host:port/db"
            ) from exc
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            self._failed("connect", exc)


def redact(url: str) -> str:
    """``scheme://host:port/db`` of ``url``, without user or password, for logs and errors."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
