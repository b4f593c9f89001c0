"""The lease: a decode worker's grant to one prefill worker to write one request's prompt KV into some of its
blocks, from the signed grant to the deletion of its record in Redis.

Life of one lease (decode worker D, prefill worker P, one request):

1. **Grant** (D, ``grant``): D fills in the lease fields of the ``KVDestination`` it sends with ``Prefill``
   and signs them: P may write ``block_ids`` (and read ``cached_block_ids``, whose tokens the grant names by
   their prefix hash) until a deadline, once (a nonce).
2. **Record** (D, ``Registry.put_lease``): D writes a ``LeaseRecord`` to ``kvserve:lease:{request_id}`` in
   state ``pending``, with a TTL: for operators, and for P's end of it.
3. **Check** (P, ``request_refusal``): P writes only under a grant that verifies, names it, has not expired,
   stays inside the pool and was never used before (``NonceBook``: a captured ``PrefillRequest`` replayed is
   refused); it maps only pool files in its own cluster's directory.
4. **End** (P, ``Registry.end_lease``): once P will never read or write under the lease again it sets the
   record's final state, ``success`` or ``failed``, signed by itself (``end_signature``); a restarted P ends
   the leases its dead predecessor left pending (``Registry.end_leases_of``). D may then free the blocks
   before the lease runs out.
5. **Delete** (D, ``Registry.delete_lease``): D, the holder, removes the record once the blocks are its own
   again (only while it names that writer: a retry may have replaced it).

Signatures: each kind of record is signed for a purpose of its own, so none verifies as another: the grant
(``GRANT_PURPOSE``) covers every field of the ``KVDestination`` (``_grant_parts``: whatever is set, by field
number, so a field added to the message is covered too); the Redis record (``RECORD_PURPOSE``) covers all
but its state; a final state carries the writer's ``END_PURPOSE`` signature, and one that does not verify
reads as ``pending``. All three use the lease key (``security.keys``), which decode and prefill workers hold and
the router does not. The check of a grant needs no Redis: the hand-off stays off it.

Time: P stops reading and writing ``WRITE_MARGIN_S`` before the expiry (``write_deadline``, checked before
every layer's store and every copy, so no step runs on past it by more than one layer); D hands the blocks
to another request only once P has ended the lease, or ``LEASE_GRACE_S`` after the expiry. A write that
began before the cutoff thus always lands before the blocks change hands.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf.message import Message

from kvstore.prefix_hash import block_hashes
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend

if TYPE_CHECKING:  # cluster_state sits beside rpc: it takes the caller's credentials, never imports them
    from security.auth import Security
    from security.identity import Identity

GRANT_PURPOSE = "lease-grant"
RECORD_PURPOSE = "lease-record"
END_PURPOSE = "lease-end"
# ``pending`` while the writer may still write. The writer alone ends it, once it will never write under it
# again: ``success`` (all blocks written) or ``failed`` (stopped, or never started).
LEASE_STATES = ("pending", "success", "failed")
FINAL_STATES = LEASE_STATES[1:]
# The holder deletes a lease's record only while it names the writer it gave it to (a retry may have replaced it).
# KEYS: the record. ARGV: the writer's (prefill worker's) id.
DELETE_IF_WRITER_SCRIPT = """
if redis.call('HGET', KEYS[1], 'prefill_id') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Reads and writes stop this long before the lease's expiry, so that the answer (checksummed) can still reach
# the decode worker in time; one layer's store is far shorter, and the decode worker's grace covers it anyway.
WRITE_MARGIN_S = 0.1
# Blocks a prefill worker was granted are reused only once it has ended its lease, or this long after the
# lease's expiry: what can land after ``write_deadline`` is at most one layer's store under way then, or (on a
# GPU) the steps still queued on its stream: far below this, whatever the step's length.
LEASE_GRACE_S = 2.0


# ---- the grant: lease fields of a KVDestination, signed by the decode worker ---------------------------------


def grant(security: Security, request_id: str, dest: pb.KVDestination, prefill_worker_id: str, ttl_s: float,
          cached_tokens: Sequence[int] = (), num_cached_tokens: int = 0) -> None:  # fmt: skip
    """Fill in ``dest``'s lease fields: ``prefill_worker_id`` may write ``dest.block_ids`` (and read
    ``dest.cached_block_ids``, which hold the KV of ``cached_tokens``) for ``ttl_s``, once, for a request
    whose destination holds ``num_cached_tokens`` leading tokens already. ``PermissionError`` when
    ``security`` holds no lease key (the router's)."""
    dest.prefill_worker_id = prefill_worker_id
    dest.lease_expires_unix_ms = int((time.time() + ttl_s) * 1000)
    dest.cached_prefix_hash = _prefix_hash(cached_tokens, len(dest.cached_block_ids), dest.fingerprint)
    dest.num_cached_tokens = num_cached_tokens
    dest.lease_nonce = secrets.token_hex(16)
    dest.lease_signature = security.sign(GRANT_PURPOSE, *_grant_parts(request_id, dest))


def confirms_prefix(dest: pb.KVDestination, cached_tokens: Sequence[int]) -> bool:
    """Whether the grant's ``cached_block_ids`` hold the KV of exactly ``cached_tokens`` (the prompt's prefix
    the caller would read from them): the signed prefix hash names these tokens."""
    expected = _prefix_hash(cached_tokens, len(dest.cached_block_ids), dest.fingerprint)
    return bool(expected) and dest.cached_prefix_hash == expected


def write_deadline(dest: pb.KVDestination) -> float:
    """The ``time.monotonic()`` instant from which the holder must neither read nor write ``dest``: the
    lease's expiry less ``WRITE_MARGIN_S`` (the lease is wall-clock; the engine measures monotonic time)."""
    return time.monotonic() + dest.lease_expires_unix_ms / 1000 - time.time() - WRITE_MARGIN_S


class NonceBook:
    """The nonces of the grants a prefill worker accepted, each kept until its lease expires (a later use of an
    expired grant is refused for its expiry anyway). One event loop uses it: no lock."""

    def __init__(self) -> None:
        self._expiry_ms: dict[str, int] = {}
        self._pruned_at = 0.0

    def accept(self, dest: pb.KVDestination) -> bool:
        """Record ``dest``'s nonce; False when it was recorded before (the grant was used already)."""
        now = time.time()
        if now - self._pruned_at >= 1.0:
            self._pruned_at = now
            self._expiry_ms = {n: t for n, t in self._expiry_ms.items() if t > now * 1000}
        if dest.lease_nonce in self._expiry_ms:
            return False
        self._expiry_ms[dest.lease_nonce] = dest.lease_expires_unix_ms
        return True


def grant_refusal(security: Security, request_id: str, dest: pb.KVDestination, worker_id: str, pool_dir: Path,
                  nonces: NonceBook) -> str:  # fmt: skip
    """Why this prefill worker must not write to ``dest`` for ``request_id`` ('' when it may, and then the
    grant counts as used: ``nonces`` refuses it from now on)."""
    if not dest.lease_nonce or not security.verify(dest.lease_signature, GRANT_PURPOSE,
                                                   *_grant_parts(request_id, dest)):  # fmt: skip
        return f"no valid lease from decode worker {dest.worker_id!r} for request {request_id!r}"
    if dest.prefill_worker_id != worker_id:
        return f"the lease is for prefill worker {dest.prefill_worker_id!r}, not {worker_id!r}"
    if write_deadline(dest) <= time.monotonic():
        return f"the lease has expired (or expires within {WRITE_MARGIN_S:g} s)"
    bad = [b for b in [*dest.block_ids, *dest.cached_block_ids] if not 0 <= b < dest.num_blocks]
    if bad:
        return f"block ids {bad[:4]} are outside the destination pool of {dest.num_blocks} blocks"
    if dest.backend == Backend.SHM:
        for path in [dest.shm_path, *dest.part_shm_paths]:
            if problem := _pool_file_refusal(Path(path), dest.worker_id, pool_dir):
                return problem
    if not nonces.accept(dest):
        return f"the lease for request {request_id!r} was used already: a replayed call is refused"
    return ""


def request_refusal(security: Security, request: pb.PrefillRequest, caller: Identity | None, worker_id: str,
                    pool_dir: Path, nonces: NonceBook) -> str:  # fmt: skip
    """``grant_refusal`` of ``request``'s grant, and the request's agreement with it: its ``num_cached_tokens``
    is the one granted, and (with cluster certificates) ``caller`` is the decode worker whose pool it names."""
    dest = request.destination
    if security.identity is not None and (caller is None or caller.name != dest.worker_id):
        return f"a lease on decode worker {dest.worker_id!r}'s pool comes from that worker only, not from {caller}"
    if request.num_cached_tokens != dest.num_cached_tokens:
        return f"num_cached_tokens={request.num_cached_tokens} differs from the lease's {dest.num_cached_tokens}"
    return grant_refusal(security, request.request_id, dest, worker_id, pool_dir, nonces)


def _grant_parts(request_id: str, dest: pb.KVDestination) -> list[str]:
    """The request id, then every field of ``dest`` that is set but the signature, as ``number:length:value``
    (a value cannot pose as a neighbour's: lengths delimit them, whatever bytes they hold)."""
    parts = [request_id]
    for desc, value in dest.ListFields():
        if desc.name == "lease_signature":
            continue
        if isinstance(value, bytes):
            text = value.hex()
        elif isinstance(value, Message):
            text = value.SerializeToString(deterministic=True).hex()
        elif isinstance(value, str | int | float | bool):
            text = str(value)
        else:  # a repeated scalar field
            text = ",".join(map(str, value))
        parts.append(f"{desc.number}:{len(text)}:{text}")
    return parts


def _prefix_hash(token_ids: Sequence[int], num_blocks: int, salt: str) -> str:
    """The chained hash of ``token_ids`` split into ``num_blocks`` equal full blocks: the name prefix caches
    give those tokens. '' when they do not split so (no blocks, or no tokens to name)."""
    if not num_blocks or not token_ids or len(token_ids) % num_blocks:
        return ""
    return block_hashes(token_ids, len(token_ids) // num_blocks, salt)[-1]


def _pool_file_refusal(path: Path, worker_id: str, pool_dir: Path) -> str:
    """A pool file may be mapped only when it is a regular file of this user, mode 0600, in the cluster's
    pool directory, named for the decode worker that holds the lease."""
    try:
        real = path.resolve(strict=True)
        info = os.lstat(real)
    except OSError as err:
        return f"cannot open the destination pool {path}: {err.strerror}"
    if real.parent != pool_dir.resolve() or not real.name.startswith(f"kvserve-{worker_id}-"):
        return f"{path} is not a KV pool of decode worker {worker_id!r} in this cluster's pool directory"
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o600:
        return f"{path} is not a private (0600) pool file of this user"
    return ""


# ---- the record in Redis: what was granted, and how the writer ended it --------------------------------------


@dataclass(frozen=True)
class LeaseRecord:
    """A lease as Redis holds it: ``prefill_id`` writes into ``block_ids`` of ``decode_id`` for ``request_id``.

    The decode worker's signature covers everything but ``state``; a final state carries the writer's own
    signature (``end_signature``), and one that does not verify reads as ``pending``.
    """

    request_id: str
    decode_id: str
    prefill_id: str
    block_ids: list[int]
    state: str = "pending"

    @property
    def ended(self) -> bool:
        """Whether the writer said it will never write under this lease again."""
        return self.state != "pending"

    def to_redis(self, security: Security) -> dict[str, str]:
        fields = {"decode_id": self.decode_id, "prefill_id": self.prefill_id,
                  "block_ids": json.dumps([int(b) for b in self.block_ids]), "state": self.state}  # fmt: skip
        fields["signature"] = security.sign(RECORD_PURPOSE, self.request_id, *_record_parts(fields))
        return fields

    @classmethod
    def from_redis(cls, request_id: str, fields: Mapping[str, str], security: Security) -> LeaseRecord:
        """Inverse of ``to_redis``; raises ``KeyError`` or ``ValueError`` on a malformed or unverified hash."""
        if not security.verify(fields.get("signature", ""), RECORD_PURPOSE, request_id, *_record_parts(fields)):
            raise ValueError(f"lease {request_id!r} does not verify")
        state = fields["state"]
        end_parts = _end_parts(request_id, fields["prefill_id"], state)
        if state != "pending" and not security.verify(fields.get("state_signature", ""), END_PURPOSE, *end_parts):
            state = "pending"  # only the writer can end its lease
        return cls(request_id, fields["decode_id"], fields["prefill_id"], json.loads(fields["block_ids"]), state)


def end_signature(security: Security, request_id: str, prefill_id: str, state: str) -> str:
    """The writer ``prefill_id``'s signature of the final ``state`` of its lease for ``request_id``;
    ``ValueError`` unless ``state`` is one of ``FINAL_STATES``."""
    if state not in FINAL_STATES:
        raise ValueError(f"a lease ends in one of {FINAL_STATES}, got {state!r}")
    return security.sign(END_PURPOSE, *_end_parts(request_id, prefill_id, state))


def _end_parts(request_id: str, prefill_id: str, state: str) -> list[str]:
    return [request_id, prefill_id, state]


def _record_parts(fields: Mapping[str, str]) -> list[str]:
    return [fields.get(name, "") for name in ("decode_id", "prefill_id", "block_ids")]
