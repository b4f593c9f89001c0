"""Moving a prompt's KV from a prefill worker into a decode worker's blocks.

Three backends, picked per worker pair by ``choose_backend``:

* ``shm`` (same host, CPU): the decode worker's whole pool lives in one
  shared-memory file (mode 0600). The prefill worker maps it once
  (``open_shared_pool``) and its attention layers store each new token's K/V
  straight into the destination slots of that mapping (``kv_cache.KVMirror``),
  so the bytes land in the decode worker's memory with no copy in between.
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
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.private_dir import private_dir

SHM_ROOT = Path("/dev/shm")
SHM_DIR_ENV = "KVSERVE_SHM_DIR"  # the cluster's directory of pool files; ``kvserve up`` sets one per cluster
CHUNK_BLOCKS = 16  # blocks per gRPC KV chunk (about 12 MB for the bundled model in float32)

log = logging.getLogger(__name__)


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


def pool_dir() -> Path:
    """This process's directory of shared-memory pool files: ``$KVSERVE_SHM_DIR``, else ``kvserve-<uid>`` under
    /dev/shm (or $TMPDIR where there is no /dev/shm). A prefill worker maps only pool files inside its own
    ``pool_dir()``: the cluster's directory. It is created mode 0700, and one that another user made first
    (or a link) is refused with ``RuntimeError`` (``kvstore.private_dir``)."""
    configured = os.environ.get(SHM_DIR_ENV)
    root = SHM_ROOT if SHM_ROOT.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    directory = Path(configured) if configured else root / f"kvserve-{os.getuid()}"
    directory.parent.mkdir(parents=True, exist_ok=True)
    return private_dir(directory)


def pool_file_name(worker_id: str, pid: int) -> str:
    return f"kvserve-{worker_id}-{pid}"


def pool_file_pid(name: str) -> int | None:
    """The owning process's pid in a pool file's name (``pool_file_name``); ``None`` for another name."""
    prefix, _, pid = name.rpartition("-")
    return int(pid) if prefix.startswith("kvserve-") and pid.isdigit() else None


def remove_stale_pools(directory: Path) -> list[Path]:
    """Delete pool files whose owning process (the pid in the name) no longer exists; returns them."""
    removed = []
    for path in directory.glob("kvserve-*-*"):
        pid = pool_file_pid(path.name)
        if pid is not None and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _pool_space_shortfall(directory: Path, nbytes: int) -> str | None:
    """Why a pool of ``nbytes`` cannot safely live in ``directory``, or None when it fits.

    Pool files are sparse: the filesystem (tmpfs) allocates each page on its first write, and a write that
    finds it full kills the writer with SIGBUS, long after start-up. So a new pool must fit the free space
    less what the pool files already there may still claim (their size beyond the pages they hold).
    """
    fs = os.statvfs(directory)
    available = fs.f_bavail * fs.f_frsize
    promised = 0
    for other in directory.glob("kvserve-*-*"):
        try:
            st = other.stat()
        except FileNotFoundError:  # removed since the listing
            continue
        promised += max(0, st.st_size - st.st_blocks * 512)
    if nbytes <= available - promised:
        return None
    held = f", {_mib(promised)} of it promised to other KV pools there" if promised else ""
    return (f"the KV pool needs {_mib(nbytes)} but the filesystem of {directory} has {_mib(available)} free"
            f"{held}: keeping the pool in private memory instead, so prefill workers on this host send its KV "
            "over gRPC, not through shared memory. To share it, give that filesystem room (Docker: --shm-size, "
            f"compose: shm_size; or {SHM_DIR_ENV} on a larger tmpfs) or make the pool smaller (--num-blocks, "
            "--kv-cache-memory-bytes); a decode worker's --no-shm keeps it private without this warning")


def create_shared_pool(spec: KVCacheSpec, num_blocks: int, name: str) -> tuple[KVCache, Path | None]:
    """A KV pool whose bytes live in a new shared-memory file readable and writable by this user only.

    When the pool does not fit the free space of that file's filesystem (``_pool_space_shortfall``) it is
    made in private memory instead, with a warning, and the path returned is None: nobody maps it then.
    """
    directory = pool_dir()
    nbytes = spec.total_bytes(num_blocks)
    shortfall = _pool_space_shortfall(directory, nbytes)
    if shortfall is not None:
        log.warning(shortfall)
        return KVCache(spec, num_blocks, "cpu"), None
    path = directory / pool_file_name(name, os.getpid())
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


# -- block bytes (grpc backend and checksums) ---------------------------------------------------------


def _regions(cache: KVCache) -> list[torch.Tensor]:
    """Every layer's K, V (and scale) regions, each viewed as ``(num_blocks, bytes per block)`` uint8."""
    regions = []
    for layer in cache.layers:
        for t in (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale):
            if t is not None:
                regions.append(t.view(t.shape[0], -1).view(torch.uint8))
    return regions


def block_nbytes(cache: KVCache) -> int:
    """Bytes of one block across every layer and region."""
    return sum(r.shape[1] for r in _regions(cache))


def _region_parts(cache: KVCache, flat, n: int):
    """``(region, part)`` pairs: ``flat``, the region-major bytes of ``n`` blocks, cut at each region's share."""
    offset = 0
    for region in _regions(cache):
        size = n * region.shape[1]
        yield region, flat[offset : offset + size].reshape(n, -1)
        offset += size


def read_blocks(cache: KVCache, block_ids: list[int]) -> bytes:
    """The blocks' bytes, region-major: for each layer's K, V (then scales), those blocks in order.

    Region-major keeps every region's part one contiguous run, so reading and writing are one
    ``index_select`` / ``index_copy_`` per region straight between the pool and the byte buffer.
    """
    device = cache.buffer.device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    out = torch.empty(len(block_ids) * block_nbytes(cache), dtype=torch.uint8, device=device)
    for region, part in _region_parts(cache, out, len(block_ids)):
        torch.index_select(region, 0, index, out=part)
    return out.cpu().numpy().tobytes()


def write_blocks(cache: KVCache, block_ids: list[int], data: bytes) -> None:
    """Inverse of ``read_blocks``: write ``data`` into ``block_ids`` of this pool.

    Runs on gRPC threads, so on the CPU it copies with NumPy, not with PyTorch ops
    that would start another OpenMP pool (see ``rpc.loop.Loop``).
    """
    n = len(block_ids)
    bad = [b for b in block_ids if not 0 <= b < cache.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:4]} are outside this pool of {cache.num_blocks} blocks")
    if len(data) != n * block_nbytes(cache):
        raise ValueError(f"KV chunk holds {len(data)} bytes, {n} blocks need {n * block_nbytes(cache)}")
    device = cache.buffer.device
    if device.type == "cpu":
        index = np.asarray(block_ids, dtype=np.int64)
        for region, part in _region_parts(cache, np.frombuffer(data, dtype=np.uint8), n):
            region.numpy()[index] = part
        return
    with warnings.catch_warnings():  # read-only source: torch warns that it cannot write to ``bytes``
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(data, dtype=torch.uint8).to(device)
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    for region, part in _region_parts(cache, source, n):
        region.index_copy_(0, index, part)


def checksum(data: bytes) -> str:
    """xxh3-128 of ``data``: fast enough (~10 GB/s) to verify every hand-off."""
    return xxhash.xxh3_128_hexdigest(data)


def chunked(block_ids: list[int]) -> list[list[int]]:
    """How a hand-off splits its blocks into chunks of ``CHUNK_BLOCKS``."""
    return [block_ids[i : i + CHUNK_BLOCKS] for i in range(0, len(block_ids), CHUNK_BLOCKS)]


def checksum_blocks(cache: KVCache, block_ids: list[int]) -> str:
    """The checksum of a hand-off of ``block_ids``: of ``read_blocks`` of each chunk, in order.

    On the CPU it hashes the pool in place, without copying the blocks out.
    """
    hasher = xxhash.xxh3_128()
    for chunk in chunked(block_ids):
        if cache.buffer.device.type != "cpu":
            hasher.update(read_blocks(cache, chunk))
            continue
        for region in _regions(cache):
            for block in chunk:
                hasher.update(region[block].numpy())
    return hasher.hexdigest() if block_ids else ""


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
