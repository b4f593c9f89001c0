"""The ``shm`` transport (same host, CPU): the decode worker's pool is a shared-memory file
(``kvstore.shared_pool``), or one file per tensor-parallel rank (``KVDestination.kv_heads``); the prefill
worker maps them once and writes the KV into them in place, each file its heads (``kvstore.split_pool``).

The lease check has already confirmed the file is a private pool file of that decode worker in this
cluster's pool directory. The mapping pins the pool's whole size in memory even after the file is removed,
so the prefill worker drops it once the file is gone (``gone``): the decode worker died.
"""

from __future__ import annotations

import dataclasses
import os

from kvstore.kv_cache import KVCacheSpec
from kvstore.shared_pool import map_pool_file
from kvstore.split_pool import SplitPool, parse_layout
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.interface import InPlaceTransport, Origin


def dest_parts(dest: pb.KVDestination, spec: KVCacheSpec) -> list[tuple[KVCacheSpec, str]]:
    """Each part of ``dest``'s pool (its spec and file): one, or one per tensor-parallel rank (``kv_heads``);
    ``ValueError`` when the layout cannot be mapped onto ``spec`` (the unsplit pool's)."""
    paths = [dest.shm_path, *dest.part_shm_paths]
    heads = parse_layout(dest.kv_heads, spec.num_kv_heads, len(paths))
    return [(dataclasses.replace(spec, num_kv_heads=h), path) for h, path in zip(heads, paths, strict=True)]


class ShmTransport(InPlaceTransport):
    """A mapped pool file, with the file held open to see it removed (its link count drops to 0)."""

    backend = Backend.SHM

    def __init__(self, worker_id: str, pool: SplitPool, files: list[int]) -> None:
        super().__init__(worker_id, pool)
        self._files = files

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        return f"shm:{dest.shm_path}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> ShmTransport:
        files, parts = [], []
        try:
            for spec, path in dest_parts(dest, origin.spec):
                files.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                parts.append(map_pool_file(spec, dest.num_blocks, path))
                held, mapped = os.fstat(files[-1]), os.stat(path)
                if (held.st_dev, held.st_ino) != (mapped.st_dev, mapped.st_ino):
                    raise ValueError(f"{path} was replaced while it was being mapped")
        except BaseException:
            for file in files:
                os.close(file)
            raise
        return cls(dest.worker_id, SplitPool(parts), files)

    def gone(self) -> bool:
        return any(os.fstat(file).st_nlink == 0 for file in self._files)

    def close(self) -> None:
        for file in self._files:
            os.close(file)
