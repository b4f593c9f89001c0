"""Moving a prompt's KV from a prefill worker into a decode worker's blocks.

Three backends, picked per worker pair by ``choose_backend``:

* ``shm`` (same host, CPU): the decode worker's whole pool lives in one
  shared-memory file (mode 0600). The prefill worker maps it once
  (``open_shared_pool``) and its attention layers store each new token's K/V
  straight into the destination slots of that mapping (``KVMirror``), so
  the bytes land in the decode worker's memory with no copy in between.
* ``cuda_ipc`` (same host, GPU): the same, with the pool's CUDA IPC handle.
* ``grpc`` (otherwise): the prefill worker reads the finished blocks out of
  its own pool (``read_blocks``) and streams them in chunks with checksums;
  the decode worker verifies and writes them (``write_blocks``).

Either way both sides can compute ``checksum_blocks`` over the destination
blocks and compare. Workers whose ``fingerprint`` differs never exchange KV.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvstore.kv_cache import KVCache, KVCacheSpec, LayerKV

SHM_DIR = Path("/dev/shm")


def fingerprint(architecture: str, spec: KVCacheSpec, extra: str = "") -> str:
    """Identifies a KV layout: two pools with equal fingerprints hold interchangeable bytes."""
    parts = [architecture, str(spec.dtype), spec.kv_cache_dtype, str(spec.num_layers), str(spec.num_kv_heads),
             str(spec.head_dim), str(spec.block_size), extra]  # fmt: skip
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def choose_backend(src_host: str, dst_host: str, dst_device: str, dst_has_shm: bool) -> str:
    if src_host == dst_host:
        if dst_device.startswith("cuda"):
            return "cuda_ipc"
        if dst_has_shm:
            return "shm"
    return "grpc"


# -- shared-memory pools ------------------------------------------------------------------------------


def create_shared_pool(spec: KVCacheSpec, num_blocks: int, name: str) -> tuple[KVCache, Path]:
    """A KV pool whose bytes live in a new shared-memory file readable and writable by this user only."""
    directory = SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = directory / f"kvserve-{name}-{os.getpid()}"
    nbytes = spec.total_bytes(num_blocks)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return KVCache(spec, num_blocks, "cpu", buffer=buffer), path


def open_shared_pool(spec: KVCacheSpec, num_blocks: int, path: str | Path) -> KVCache:
    """Map another process's pool file; writes go straight into that process's memory."""
    nbytes = spec.total_bytes(num_blocks)
    actual = os.stat(path).st_size
    if actual != nbytes:
        raise ValueError(f"shared KV pool {path} has {actual} bytes, expected {nbytes}: layouts differ")
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return KVCache(spec, num_blocks, "cpu", buffer=buffer)


# -- mirrored writes ----------------------------------------------------------------------------------


@dataclass
class KVMirror:
    """A second pool that some of a batch's tokens must also be stored into, and where.

    ``slot_mapping`` has one entry per token of the batch: the destination slot,
    or -1 for tokens that do not go there.
    """

    layers: list[LayerKV]
    slot_mapping: torch.Tensor


# -- block bytes (grpc backend and checksums) ---------------------------------------------------------


def _regions(layer: LayerKV) -> list[torch.Tensor]:
    return [t for t in (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale) if t is not None]


def block_nbytes(cache: KVCache) -> int:
    """Bytes of one block across every layer and region."""
    return sum(t[0].numel() * t.element_size() for layer in cache.layers for t in _regions(layer))


def read_blocks(cache: KVCache, block_ids: list[int]) -> bytes:
    """The blocks' bytes: for each block in order, every layer's regions (K, V, then scales)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.buffer.device)
    per_region = [t.index_select(0, index).view(len(block_ids), -1).view(torch.uint8)
                  for layer in cache.layers for t in _regions(layer)]  # fmt: skip
    return torch.cat(per_region, dim=1).cpu().numpy().tobytes()


def write_blocks(cache: KVCache, block_ids: list[int], data: bytes) -> None:
    """Inverse of ``read_blocks``: write ``data`` into ``block_ids`` of this pool."""
    n = len(block_ids)
    if len(data) != n * block_nbytes(cache):
        raise ValueError(f"KV chunk holds {len(data)} bytes, {n} blocks need {n * block_nbytes(cache)}")
    rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, -1).to(cache.buffer.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.buffer.device)
    offset = 0
    for layer in cache.layers:
        for t in _regions(layer):
            width = t[0].numel() * t.element_size()
            t.view(t.shape[0], -1).view(torch.uint8).index_copy_(0, index, rows[:, offset : offset + width])
            offset += width


def checksum(data: bytes) -> str:
    """xxh3-128 of ``data``: fast enough (~10 GB/s) to verify every hand-off."""
    return xxhash.xxh3_128_hexdigest(data)


def checksum_blocks(cache: KVCache, block_ids: list[int]) -> str:
    """``checksum(read_blocks(cache, block_ids))``, hashed in place on the CPU (no copy of the blocks)."""
    if not block_ids:
        return ""
    if cache.buffer.device.type != "cpu":
        return checksum(read_blocks(cache, block_ids))
    hasher = xxhash.xxh3_128()
    regions = [t for layer in cache.layers for t in _regions(layer)]
    for block in block_ids:
        for t in regions:
            hasher.update(t[block].view(torch.uint8).numpy())
    return hasher.hexdigest()


# -- CUDA IPC pools -----------------------------------------------------------------------------------


def export_cuda_ipc(cache: KVCache) -> bytes:
    """A handle another process on this GPU can open with ``open_cuda_ipc_pool`` (JSON, no pickle)."""
    storage = cache.buffer.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    fields = {"device": device, "handle": handle.hex(), "size": size, "offset": offset,
              "ref_handle": ref_handle.hex(), "ref_offset": ref_offset, "event_handle": event_handle.hex(),
              "event_sync": bool(event_sync), "nbytes": cache.nbytes}  # fmt: skip
    return json.dumps(fields).encode()


def open_cuda_ipc_pool(spec: KVCacheSpec, num_blocks: int, exported: bytes) -> KVCache:
    """Open another process's pool on the same GPU: device-to-device writes land in its memory."""
    f = json.loads(exported)
    nbytes = spec.total_bytes(num_blocks)
    if f["nbytes"] != nbytes:
        raise ValueError(f"exported KV pool has {f['nbytes']} bytes, expected {nbytes}: layouts differ")
    storage = torch.UntypedStorage._new_shared_cuda(
        f["device"], bytes.fromhex(f["handle"]), f["size"], f["offset"], bytes.fromhex(f["ref_handle"]),
        f["ref_offset"], bytes.fromhex(f["event_handle"]), f["event_sync"],
    )  # fmt: skip
    device = torch.device("cuda", f["device"])
    buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    return KVCache(spec, num_blocks, device, buffer=buffer)
