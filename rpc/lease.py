"""The lease a decode worker hands a prefill worker with a ``Prefill`` call, and its check on the other side.

The decode worker grants one prefill worker the right to write one request's prompt KV into some of its
blocks (and to read the blocks that already hold the prompt's cached prefix, whose tokens the grant names by
their prefix hash) until a deadline, and signs that grant with the cluster token (``Security.sign``). The
prefill worker reads or writes only under a grant that verifies, names it, has not expired and stays inside
the pool; it maps only pool files in its own cluster's directory. Nothing here needs Redis: the hand-off
stays off it.

Time: the prefill worker stops reading and writing ``WRITE_MARGIN_S`` before the expiry (``write_deadline``,
checked before every layer's store and every copy, so no step runs on past it by more than one layer); the
decode worker hands the blocks to another request only once the writer has ended the lease, or a grace
after the expiry (``decode_service.prefill_client.LEASE_GRACE_S``). A write that began before the cutoff
thus always lands before the blocks change hands.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.prefix_hash import block_hashes
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.auth import Security

# Reads and writes stop this long before the lease's expiry, so that the answer (checksummed) can still reach
# the decode worker in time; one layer's store is far shorter, and the decode worker's grace covers it anyway.
WRITE_MARGIN_S = 0.1


def _parts(request_id: str, dest: pb.KVDestination) -> tuple[object, ...]:
    return ("lease", request_id, dest.worker_id, dest.prefill_worker_id, dest.backend, dest.address,
            ",".join(map(str, dest.block_ids)), dest.shm_path, dest.num_blocks, dest.lease_expires_unix_ms,
            ",".join(map(str, dest.cached_block_ids)), dest.cached_prefix_hash)  # fmt: skip


def prefix_hash(token_ids: Sequence[int], num_blocks: int, salt: str) -> str:
    """The chained hash of ``token_ids`` split into ``num_blocks`` equal full blocks: the name prefix caches
    give those tokens. '' when they do not split so (no blocks, or no tokens to name)."""
    if not num_blocks or not token_ids or len(token_ids) % num_blocks:
        return ""
    return block_hashes(token_ids, len(token_ids) // num_blocks, salt)[-1]


def grant(security: Security, request_id: str, dest: pb.KVDestination, prefill_worker_id: str, ttl_s: float,
          cached_tokens: Sequence[int] = ()) -> None:  # fmt: skip
    """Fill in ``dest``'s lease fields: ``prefill_worker_id`` may write ``dest.block_ids`` (and read
    ``dest.cached_block_ids``, which hold the KV of ``cached_tokens``) for ``ttl_s``."""
    dest.prefill_worker_id = prefill_worker_id
    dest.lease_expires_unix_ms = int((time.time() + ttl_s) * 1000)
    dest.cached_prefix_hash = prefix_hash(cached_tokens, len(dest.cached_block_ids), dest.fingerprint)
    dest.lease_signature = security.sign(*_parts(request_id, dest))


def confirms_prefix(dest: pb.KVDestination, cached_tokens: Sequence[int]) -> bool:
    """Whether the lease's ``cached_block_ids`` hold the KV of exactly ``cached_tokens`` (the prompt's prefix
    the caller would read from them): the signed prefix hash names these tokens."""
    expected = prefix_hash(cached_tokens, len(dest.cached_block_ids), dest.fingerprint)
    return bool(expected) and dest.cached_prefix_hash == expected


def write_deadline(dest: pb.KVDestination) -> float:
    """The ``time.monotonic()`` instant from which the holder must neither read nor write ``dest``: the
    lease's expiry less ``WRITE_MARGIN_S`` (the lease is wall-clock; the engine measures monotonic time)."""
    return time.monotonic() + dest.lease_expires_unix_ms / 1000 - time.time() - WRITE_MARGIN_S


def refusal(security: Security, request_id: str, dest: pb.KVDestination, worker_id: str, pool_dir: Path) -> str:
    """Why this prefill worker must not write to ``dest`` for ``request_id`` ('' when it may)."""
    if not security.verify(dest.lease_signature, *_parts(request_id, dest)):
        return f"no valid lease from decode worker {dest.worker_id!r} for request {request_id!r}"
    if dest.prefill_worker_id != worker_id:
        return f"the lease is for prefill worker {dest.prefill_worker_id!r}, not {worker_id!r}"
    if write_deadline(dest) <= time.monotonic():
        return f"the lease has expired (or expires within {WRITE_MARGIN_S:g} s)"
    bad = [b for b in [*dest.block_ids, *dest.cached_block_ids] if not 0 <= b < dest.num_blocks]
    if bad:
        return f"block ids {bad[:4]} are outside the destination pool of {dest.num_blocks} blocks"
    if dest.backend == "shm":
        return _pool_file_refusal(Path(dest.shm_path), dest.worker_id, pool_dir)
    return ""


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
