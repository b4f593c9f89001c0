"""The lease a decode worker hands a prefill worker with a ``Prefill`` call, and its check on the other side.

The decode worker grants one prefill worker the right to write one request's prompt KV into some of its
blocks (and to read the blocks that already hold the prompt's cached prefix) until a deadline, and signs
that grant with the cluster token (``Security.sign``). The prefill worker reads or writes only under a grant
that verifies, names it, has not expired and stays inside the pool; it maps only pool files in its own
cluster's directory. Nothing here needs Redis: the hand-off stays off it.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.auth import Security


def _parts(request_id: str, dest: pb.KVDestination) -> tuple[object, ...]:
    return ("lease", request_id, dest.worker_id, dest.prefill_worker_id, dest.backend, dest.address,
            ",".join(map(str, dest.block_ids)), dest.shm_path, dest.num_blocks, dest.lease_expires_unix_ms,
            ",".join(map(str, dest.cached_block_ids)))  # fmt: skip


def grant(security: Security, request_id: str, dest: pb.KVDestination, prefill_worker_id: str, ttl_s: float) -> None:
    """Fill in ``dest``'s lease fields: ``prefill_worker_id`` may write ``dest.block_ids`` (and read
    ``dest.cached_block_ids``) for ``ttl_s``."""
    dest.prefill_worker_id = prefill_worker_id
    dest.lease_expires_unix_ms = int((time.time() + ttl_s) * 1000)
    dest.lease_signature = security.sign(*_parts(request_id, dest))


def refusal(security: Security, request_id: str, dest: pb.KVDestination, worker_id: str, pool_dir: Path) -> str:
    """Why this prefill worker must not write to ``dest`` for ``request_id`` ('' when it may)."""
    if not security.verify(dest.lease_signature, *_parts(request_id, dest)):
        return f"no valid lease from decode worker {dest.worker_id!r} for request {request_id!r}"
    if dest.prefill_worker_id != worker_id:
        return f"the lease is for prefill worker {dest.prefill_worker_id!r}, not {worker_id!r}"
    if dest.lease_expires_unix_ms < time.time() * 1000:
        return "the lease has expired"
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
