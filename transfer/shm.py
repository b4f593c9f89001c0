"""The ``shm`` transport (same host, CPU): the decode worker's pool is a shared-memory file
(``kvstore.shared_pool``); the prefill worker maps it once and writes the KV into it in place.

The lease check has already confirmed the file is a private pool file of that decode worker in this
cluster's pool directory. The mapping pins the pool's whole size in memory even after the file is removed,
so the prefill worker drops it once the file is gone (``gone``): the decode worker died.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.interface import InPlaceTransport, Origin


def open_shared_pool(spec: KVCacheSpec, num_blocks: int, path: str | Path) -> KVCache:
    """Map another process's pool file; writes go straight into that process's memory. ``ValueError`` when
    the file's size is not that of ``num_blocks`` blocks of ``spec``."""
    nbytes = spec.total_bytes(num_blocks)
    actual = os.stat(path).st_size
    if actual != nbytes:
        raise ValueError(f"shared KV pool {path} has {actual} bytes, expected {nbytes}: layouts differ")
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return KVCache(spec, num_blocks, "cpu", buffer=buffer)


class ShmTransport(InPlaceTransport):
    """A mapped pool file, with the file held open to see it removed (its link count drops to 0)."""

    backend = Backend.SHM

    def __init__(self, worker_id: str, pool: KVCache, file: int) -> None:
        super().__init__(worker_id, pool)
        self._file = file

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        return f"shm:{dest.shm_path}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> ShmTransport:
        file = os.open(dest.shm_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pool = open_shared_pool(origin.spec, dest.num_blocks, dest.shm_path)
            held, mapped = os.fstat(file), os.stat(dest.shm_path)
            if (held.st_dev, held.st_ino) != (mapped.st_dev, mapped.st_ino):
                raise ValueError(f"{dest.shm_path} was replaced while it was being mapped")
        except BaseException:
            os.close(file)
            raise
        return cls(dest.worker_id, pool, file)

    def gone(self) -> bool:
        return os.fstat(self._file).st_nlink == 0

    def close(self) -> None:
        os.close(self._file)
