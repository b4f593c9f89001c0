"""The ``cuda_ipc`` transport (same host, GPU): the decode worker exports its pool's CUDA IPC handle once
(``export_cuda_ipc``, sent in every ``KVDestination``); the prefill worker opens it once
(``open_cuda_ipc_pool``) and its layers write the KV device-to-device into the decode worker's blocks.
"""

from __future__ import annotations

import json

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.interface import InPlaceTransport, Origin


def export_cuda_ipc(cache: KVCache) -> bytes:
    """A handle another process on this GPU can open with ``open_cuda_ipc_pool`` (JSON, no pickle)."""
    storage = cache.buffer.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    fields = {"device": device, "handle": handle.hex(), "size": size, "offset": offset,
              "ref_handle": ref_handle.hex(), "ref_offset": ref_offset, "event_handle": event_handle.hex(),
              "event_sync": bool(event_sync), "nbytes": cache.nbytes}  # fmt: skip
    return json.dumps(fields).encode()


def open_cuda_ipc_pool(spec: KVCacheSpec, num_blocks: int, exported: bytes) -> KVCache:
    """Open another process's pool on the same GPU: device-to-device writes land in its memory.
    ``ValueError`` when the exported pool's size is not that of ``num_blocks`` blocks of ``spec``."""
    f = json.loads(exported)
    nbytes = spec.total_bytes(num_blocks)
    if f["nbytes"] != nbytes:
        raise ValueError(f"exported KV pool has {f['nbytes']} bytes, expected {nbytes}: layouts differ")
    device = torch.device("cuda", f["device"])
    with torch.cuda.device(device):
        _init_cuda(device)
        storage = torch.UntypedStorage._new_shared_cuda(
            f["device"], bytes.fromhex(f["handle"]), f["size"], f["offset"], bytes.fromhex(f["ref_handle"]),
            f["ref_offset"], bytes.fromhex(f["event_handle"]), f["event_sync"],
        )  # fmt: skip
        buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    return KVCache(spec, num_blocks, device, buffer=buffer)


def _init_cuda(device: torch.device) -> None:
    """Make CUDA usable on ``device`` in this process and thread before opening an IPC handle there.

    ``_new_shared_cuda`` goes straight to the caching allocator's IPC map and the CUDA driver: in a process
    that has not used CUDA yet the allocator is not set up and there is no context on the device, and it
    dies with SIGSEGV (torch's own ``rebuild_cuda_tensor`` calls ``_lazy_init`` first for the same reason).
    ``torch.cuda.init`` sets up torch's CUDA state; a one-byte allocation creates the device's primary
    context and makes it current on this thread (the prefill worker opens pools on its event-loop thread).
    """
    torch.cuda.init()
    torch.empty(1, dtype=torch.uint8, device=device)


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
        if dest.kv_heads:
            raise ValueError("cuda_ipc reaches an unsplit pool only: the destination's heads are split over ranks")
        pool = open_cuda_ipc_pool(origin.spec, dest.num_blocks, dest.cuda_ipc_handle)
        return cls(dest.worker_id, SplitPool([pool]))
