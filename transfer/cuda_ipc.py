"""The ``cuda_ipc`` transport (same host, GPU): the decode worker exports its pool's CUDA IPC handle once
(``kvstore.ipc_pool.export_cuda_ipc``, sent in every ``KVDestination``), one per part when its heads are split
over tensor-parallel ranks (each rank's own, ``KVDestination.part_cuda_ipc_handles``); the prefill worker opens
them once (``open_cuda_ipc_pool``) and its layers write the KV device-to-device into the decode worker's
blocks, each part its heads (``kvstore.split_pool``).
"""

from __future__ import annotations

import dataclasses

from kvstore.ipc_pool import open_cuda_ipc_pool
from kvstore.split_pool import SplitPool, parse_layout
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.interface import InPlaceTransport, Origin


class CudaIpcTransport(InPlaceTransport):
    """A decode worker's pool opened from its exported handle. A restarted decode worker exports a new
    handle, which opens a new transport and closes this one; the handle itself says nothing of its
    owner's death, so nothing else closes it."""

    backend = Backend.CUDA_IPC

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        return f"cuda_ipc:{dest.worker_id}:{dest.cuda_ipc_handle[:64].hex()}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> CudaIpcTransport:
        handles = [dest.cuda_ipc_handle, *dest.part_cuda_ipc_handles]
        heads = parse_layout(dest.kv_heads, origin.spec.num_kv_heads, len(handles))
        parts = [open_cuda_ipc_pool(dataclasses.replace(origin.spec, num_kv_heads=h), dest.num_blocks, handle)
                 for h, handle in zip(heads, handles, strict=True)]  # fmt: skip
        return cls(dest.worker_id, SplitPool(parts))
