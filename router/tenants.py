"""Tenants: who sent a request (its API key), what each may use, and what each used.

A keys file (``--api-keys-file``, TOML, readable by its owner only) maps hashed API keys to tenants::

    [tenants.acme]
    key_sha256 = ["<64 hex digits>", ...]  # SHA-256 of each key (``kvserve hash-key`` prints it); a key never
    max_concurrency = 16                   # requests in flight at once (0: no bound)
    tokens_per_minute = 200000             # prompt + completion tokens (0: no bound)
    weight = 2                             # its share of the router under contention, relative (default 1)

A call carries its key as ``Authorization: Bearer <key>``; the router hashes it and looks the hash up, so the
file holds nothing a caller could present. ``--api-key`` is one more tenant, ``default``, without bounds. With
neither, every call is the tenant ``anonymous`` and no key is asked for.

Over a bound a request is refused before it is validated: 429 with ``Retry-After`` (RESOURCE_EXHAUSTED over
gRPC), saying which bound and when to retry. Tokens are counted when a request ends (its usage: prompt and
completion), into a bucket of ``tokens_per_minute`` that refills continuously; a tenant whose bucket is empty
waits until it refills. The file is read again on SIGHUP (``Tenants.reload``): a file that is refused (a key of
two tenants, a bad number, an unknown field, a mode that lets others read it) keeps the old table, and the
error is logged and counted. Counts of requests in flight and token buckets are kept by tenant name across
reloads. Metrics carry the tenant's name: at most ``MAX_TENANTS`` names, fixed by the file.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import stat
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rpc import metrics

log = logging.getLogger(__name__)
MAX_TENANTS = 256  # metrics carry each name: the file bounds their cardinality
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HASH = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"key_sha256", "max_concurrency", "tokens_per_minute", "weight"}
CONCURRENCY_RETRY_S = 1  # Retry-After of a refusal for concurrency: one request's end is the usual wait


def hash_key(key: str) -> str:
    """The hex SHA-256 of an API key, as the keys file lists it (keys are random tokens: a fast hash suffices)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrency: int = 0
    tokens_per_minute: int = 0
    weight: float = 1.0


@dataclass
class Usage:
    """A tenant's use now: requests in flight and its token bucket (``level`` tokens at ``at``)."""

    in_flight: int = 0
    level: float = math.inf
    at: float = field(default_factory=time.monotonic)

    def refill(self, tenant: Tenant, now: float) -> None:
        """Add what flowed in since ``at``: ``tokens_per_minute`` a minute, up to a minute's worth."""
        capacity = tenant.tokens_per_minute or math.inf
        self.level = capacity if self.level >= capacity else min(capacity, self.level + (now - self.at) * capacity / 60)
        self.at = now


class Refused(Exception):
    """A request over one of its tenant's bounds: the message and the seconds after which to retry."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


ANONYMOUS = Tenant("anonymous")


def load_keys_file(path: Path) -> dict[str, Tenant]:
    """The tenants of a keys file by key hash; ``ValueError`` naming the file and what to fix."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it: {err}") from None
    if mode & (stat.S_IRWXO):
        raise ValueError(f"{path}: mode {stat.filemode(mode)} lets other users read it; chmod o-rwx {path}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not TOML: {err}") from None
    if set(data) - {"tenants"} or not isinstance(data.get("tenants"), dict):
        raise ValueError(f"{path}: expected [tenants.NAME] tables only, got {sorted(data)}")
    tenants = data["tenants"]
    if len(tenants) > MAX_TENANTS:
        raise ValueError(f"{path}: {len(tenants)} tenants; at most {MAX_TENANTS}")
    by_hash: dict[str, Tenant] = {}
    for name, spec in tenants.items():
        where = f"{path}: tenants.{name}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: a tenant's name is 1-64 letters, digits, '.', '_' or '-'")
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a table, got {spec!r}")
        if set(spec) - _FIELDS:
            raise ValueError(f"{where}: unknown fields {sorted(set(spec) - _FIELDS)}; expected some of "
                             f"{sorted(_FIELDS)}")  # fmt: skip
        tenant = Tenant(name, _count(spec, "max_concurrency", where), _count(spec, "tokens_per_minute", where),
                        _weight(spec, where))  # fmt: skip
        hashes = spec.get("key_sha256")
        if not isinstance(hashes, list) or not hashes:
            raise ValueError(f"{where}: key_sha256 must be a non-empty list of SHA-256 hex digests")
        for digest in hashes:
            if not isinstance(digest, str) or not _HASH.fullmatch(digest):
                raise ValueError(f"{where}: {digest!r} is not a SHA-256 hex digest (64 lowercase hex digits; "
                                 "kvserve hash-key prints one)")  # fmt: skip
            if digest in by_hash:
                raise ValueError(f"{where}: key {digest[:12]}... is also tenant {by_hash[digest].name}'s; a key "
                                 "belongs to one tenant")  # fmt: skip
            by_hash[digest] = tenant
    return by_hash


def _count(spec: dict, name: str, where: str) -> int:
    value = spec.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {name} must be an integer >= 0 (0: no bound), got {value!r}")
    return value


def _weight(spec: dict, where: str) -> float:
    value = spec.get("weight", 1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1000:
        raise ValueError(f"{where}: weight must be a number in (0, 1000], got {value!r}")
    return float(value)


class Tenants:
    """The table the router admits requests by: the keys file's tenants and ``--api-key``'s, their use now."""

    def __init__(self, keys_file: str | None = None, api_key: str | None = None) -> None:
        self.keys_file = Path(keys_file) if keys_file else None
        self._extra = {hash_key(api_key): Tenant("default")} if api_key else {}
        self._by_hash = {**(load_keys_file(self.keys_file) if self.keys_file else {}), **self._extra}
        self._usage: dict[str, Usage] = {}

    @property
    def open(self) -> bool:
        """No key is asked for (no keys file, no ``--api-key``): every call is ``ANONYMOUS``."""
        return not self._by_hash

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); on a refused file keep the table, log why, and return False."""
        if self.keys_file is None:
            return True
        try:
            table = load_keys_file(self.keys_file)
        except ValueError as err:
            log.error("keeping the tenants as they were: %s", err)
            metrics.TENANT_RELOADS.labels("refused").inc()
            return False
        self._by_hash = {**table, **self._extra}
        metrics.TENANT_RELOADS.labels("loaded").inc()
        log.info("reloaded %s: %d tenants", self.keys_file, len({t.name for t in table.values()}))
        return True

    def identify(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant an ``Authorization`` value (``Bearer <key>``) names; None for a missing or unknown key."""
        if self.open:
            return ANONYMOUS
        given = authorization.decode(errors="replace") if isinstance(authorization, bytes) else authorization or ""
        scheme, _, token = given.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_hash.get(hash_key(token.strip()))

    def enter(self, tenant: Tenant) -> None:
        """Count a request of ``tenant`` in flight, or raise ``Refused`` when it is over a bound."""
        usage = self._usage.setdefault(tenant.name, Usage())
        now = time.monotonic()
        usage.refill(tenant, now)
        if tenant.max_concurrency and usage.in_flight >= tenant.max_concurrency:
            metrics.TENANT_REFUSED.labels(tenant.name, "concurrency").inc()
            raise Refused(f"tenant {tenant.name} has its limit of {tenant.max_concurrency} requests in flight; "
                          f"retry after one ends", CONCURRENCY_RETRY_S)  # fmt: skip
        if tenant.tokens_per_minute and usage.level <= 0:
            wait = math.ceil(-usage.level * 60 / tenant.tokens_per_minute) or 1
            metrics.TENANT_REFUSED.labels(tenant.name, "tokens_per_minute").inc()
            raise Refused(f"tenant {tenant.name} used its {tenant.tokens_per_minute} tokens per minute; retry in "
                          f"{wait} s", wait)  # fmt: skip
        usage.in_flight += 1
        metrics.TENANT_IN_FLIGHT.labels(tenant.name).set(usage.in_flight)

    def leave(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of ``tenant`` ended, having used these tokens."""
        usage = self._usage[tenant.name]
        usage.in_flight -= 1
        usage.refill(tenant, time.monotonic())
        usage.level -= prompt_tokens + completion_tokens
        metrics.TENANT_IN_FLIGHT.labels(tenant.name).set(usage.in_flight)
        metrics.TENANT_TOKENS.labels(tenant.name, "prompt").inc(prompt_tokens)
        metrics.TENANT_TOKENS.labels(tenant.name, "completion").inc(completion_tokens)
