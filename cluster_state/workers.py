"""What the registry stores about each worker (``WorkerInfo``), with its Redis hash encoding.

``cluster_state.registry.Registry`` reads and writes these records. The encoding is signed: ``to_redis`` adds
an HMAC (``security.auth.Security.sign``) over the fields that say who the worker is and where it serves, and
``from_redis`` refuses a hash whose signature does not verify. A worker's load, which steers routing too,
carries a signature of its own (``load_to_redis``), so that each heartbeat can rewrite it alone;
``verified_load`` reads it back only when that signature verifies. Each kind of record is signed for its own
purpose (here ``worker`` and ``worker-load``, under the registry key, which every member holds; the lease's
records in cluster_state/lease.py under the lease key), so none verifies as another (``security.keys``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from security.auth import Security

Role = Literal["prefill", "decode", "router"]
ROLES: tuple[str, ...] = get_args(Role)
LOAD_FIELDS = ("free_blocks", "total_blocks", "num_running", "num_waiting")
SIGNED_FIELDS = ("worker_id", "role", "address", "host_id", "device", "fingerprint", "block_size", "started_at")


def local_host_id(pool_directory: Path | None = None) -> str:
    """``<kernel>/shm-<major>:<minor>``: two workers with equal ids can map each other's shared-memory files,
    so the same-host transports (shm, cuda_ipc) may join them; workers with different ids never try.

    * kernel: the boot id, one per running kernel (containers on one machine share it, machines and VMs do
      not); the hostname where there is none (not Linux);
    * shm device: ``st_dev`` of the filesystem the KV pool files live in (``pool_directory``, default
      ``kvstore.shared_pool.pool_dir_path()``, or its nearest existing ancestor while it is not made yet).
      One tmpfs seen from two mount namespaces (a bind mount, containers sharing IPC) has one device; a
      container's own /dev/shm, or a test host's in tests/netns.py, is a filesystem of its own.

    Network namespaces and hostnames play no part: processes that share /dev/shm share memory, whatever
    network they see and whatever their hostnames say.
    """
    if pool_directory is None:
        from kvstore.shared_pool import pool_dir_path  # imports torch, which readers of worker records need not

        pool_directory = pool_dir_path()
    try:
        kernel = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        kernel = socket.gethostname()
    existing = next(p for p in (pool_directory.absolute(), *pool_directory.absolute().parents) if p.exists())
    device = existing.stat().st_dev
    return f"{kernel}/shm-{os.major(device)}:{os.minor(device)}"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker publishes about itself.

    ``address`` is its gRPC ``host:port``; two workers exchange KV only when their ``fingerprint`` strings are
    equal. ``SIGNED_FIELDS`` are fixed for the worker's life and signed; the ``LOAD_FIELDS`` change with every
    heartbeat and are signed apart from them, together with the worker's id and start time
    (``load_signature``): a load cannot be moved to another worker or to an earlier life of this one.
    """

    worker_id: str
    role: Role
    address: str
    host_id: str = field(default_factory=local_host_id)
    device: str = "cpu"
    fingerprint: str = ""
    block_size: int = 0  # tokens per KV block (0: holds no KV); with the fingerprint, what prefix hashes need
    free_blocks: int = 0
    total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    started_at: float = field(default_factory=time.time)
    # KV transports offered beyond grpc, comma-separated wire names ("nixl"; transfer.backend.Backend). Signed
    # with SIGNED_FIELDS when set (``_signed_parts``), so records written before it existed still verify.
    transports: str = ""
    # Tensor parallelism: the KV heads each rank holds, in rank order ("2,1": two ranks), '' for one device;
    # its TP size is the count. Signed like ``transports`` when set.
    kv_heads: str = ""

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.kv_heads.split(",")) if self.kv_heads else 1

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        check_load({name: getattr(self, name) for name in LOAD_FIELDS})

    def to_redis(self, security: Security) -> dict[str, str]:
        fields = {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}
        fields["signature"] = security.sign("worker", *_signed_parts(fields))
        return fields | self.load_to_redis(security)

    def load_to_redis(self, security: Security) -> dict[str, str]:
        """The load fields and their ``load_signature``: what a heartbeat writes, in one update."""
        load = {name: str(getattr(self, name)) for name in LOAD_FIELDS}
        return load | {"load_signature": security.sign(*_load_parts(self.worker_id, str(self.started_at), load))}

    @classmethod
    def from_redis(cls, fields: Mapping[str, str], security: Security, load: Mapping[str, int]) -> WorkerInfo:
        """Inverse of ``to_redis`` for the signed fields, with ``load`` as its load (``verified_load`` of the
        hash, or what the reader assumes when that is None); raises ``KeyError`` or ``ValueError`` on a
        malformed or unverified hash."""
        if not security.verify(fields.get("signature", ""), "worker", *_signed_parts(fields)):
            raise ValueError("its signature does not verify (written without the cluster token?)")
        return cls(
            worker_id=fields["worker_id"],
            role=fields["role"],  # type: ignore[arg-type]  # validated in __post_init__
            address=fields["address"],
            host_id=fields["host_id"],
            device=fields["device"],
            fingerprint=fields["fingerprint"],
            block_size=int(fields["block_size"]),
            started_at=float(fields["started_at"]),
            transports=fields.get("transports", ""),
            kv_heads=fields.get("kv_heads", ""),
            **{name: load[name] for name in LOAD_FIELDS},
        )


def _signed_parts(fields: Mapping[str, str]) -> list[str]:
    """What the record's signature covers: ``SIGNED_FIELDS``, then ``transports`` and ``kv_heads`` when set (a
    record without them signs what it did before the fields existed; one with them cannot lose them unnoticed)."""
    parts = [fields.get(name, "") for name in SIGNED_FIELDS]
    return parts + [f"{name}={fields[name]}" for name in ("transports", "kv_heads") if fields.get(name)]


def verified_load(fields: Mapping[str, str], security: Security) -> dict[str, int] | None:
    """The load fields of a worker hash, or None unless their ``load_signature`` verifies for the worker id
    and start time the hash names (whose own signature ``from_redis`` checks)."""
    load = {name: fields.get(name, "") for name in LOAD_FIELDS}
    parts = _load_parts(fields.get("worker_id", ""), fields.get("started_at", ""), load)
    if not security.verify(fields.get("load_signature", ""), *parts):
        return None
    try:
        values = {name: int(value) for name, value in load.items()}
        check_load(values)
    except ValueError:  # signed, so written by a member: only a member's bug gets here
        return None
    return values


def _load_parts(worker_id: str, started_at: str, load: Mapping[str, str]) -> list[str]:
    return ["worker-load", worker_id, started_at, *(load[name] for name in LOAD_FIELDS)]


def check_load(load: Mapping[str, Any]) -> None:
    for name in LOAD_FIELDS:
        value = load.get(name, 0)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
