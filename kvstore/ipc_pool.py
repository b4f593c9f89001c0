"""A KV pool shared with other processes on the same host through CUDA IPC: ``export_cuda_ipc`` gives a handle
(JSON, no pickle) that ``open_cuda_ipc_pool`` opens in another process, whose device-to-device copies then land
in the owner's memory. A decode worker exports its pool for prefill workers to write (``transfer.cuda_ipc``);
a tensor-parallel rank exports its part of the pool for its rank 0 to open (``engine.tensor_parallel_ranks``),
so that rank 0 reaches every head, as it maps the parts' pool files on the CPU (``kvstore.split_pool``).

A handle names its GPU by its index in the exporting process; every process of a worker and of a cluster on
one host sees the same GPUs in the same order (nothing sets ``CUDA_VISIBLE_DEVICES`` per process).
"""

from __future__ import annotations

import json

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec

HANDLE_BYTES = 2048  # room for any exported handle, padded (a handle is about 600 bytes of JSON)


def export_cuda_ipc(cache: KVCache) -> bytes:
    """A handle another process on this host can open with ``open_cuda_ipc_pool``."""
    storage = cache.buffer.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    fields = {"device": device, "handle": handle.hex(), "size": size, "offset": offset,
              "ref_handle": ref_handle.hex(), "ref_offset": ref_offset, "event_handle": event_handle.hex(),
              "event_sync": bool(event_sync), "nbytes": cache.nbytes}  # fmt: skip
    return json.dumps(fields).encode()


def open_cuda_ipc_pool(spec: KVCacheSpec, num_blocks: int, exported: bytes) -> KVCache:
    """Open another process's pool: device-to-device writes land in its memory. ``ValueError`` when the
    exported pool's size is not that of ``num_blocks`` blocks of ``spec``."""
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


def handle_to_tensor(handle: bytes, device: torch.device) -> torch.Tensor:
    """``handle`` as ``HANDLE_BYTES`` bytes on ``device``, zero-padded: what a rank gathers to rank 0."""
    if len(handle) > HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle of {len(handle)} bytes exceeds {HANDLE_BYTES}")
    out = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    out[: len(handle)] = torch.frombuffer(bytearray(handle), dtype=torch.uint8)
    return out.to(device)


def handle_from_tensor(gathered: torch.Tensor) -> bytes:
    """The handle ``handle_to_tensor`` made, read back (the JSON holds no zero byte)."""
    return gathered.cpu().numpy().tobytes().rstrip(b"\0")


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
