"""This process's KV pool in a shared-memory file, so that a prefill worker on the same host can map it and
write its prompt's KV in place (``transfer.shm`` opens it on that side).

A pool file is ``kvserve-<worker id>-<pid>`` in the cluster's pool directory (``pool_dir``, mode 0700): the
pid names its owner, so files of dead owners can be found and removed (``remove_stale_pools``) and a
restarted worker never reuses its predecessor's file. A pool is made in a file only where the filesystem
has room for all of it (``create_shared_pool``); else it lives in private memory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.private_dir import private_dir

SHM_ROOT = Path("/dev/shm")
SHM_DIR_ENV = "KVSERVE_SHM_DIR"  # the cluster's directory of pool files; ``kvserve up`` sets one per cluster

log = logging.getLogger(__name__)


def pool_dir_path() -> Path:
    """Where ``pool_dir`` is, made or not: ``$KVSERVE_SHM_DIR``, else ``kvserve-<uid>`` under /dev/shm (or
    $TMPDIR where there is no /dev/shm). Its filesystem is part of this host's identity
    (``cluster_state.workers.local_host_id``)."""
    configured = os.environ.get(SHM_DIR_ENV)
    root = SHM_ROOT if SHM_ROOT.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return Path(configured) if configured else root / f"kvserve-{os.getuid()}"


def pool_dir() -> Path:
    """This process's directory of shared-memory pool files (``pool_dir_path``). A prefill worker maps only
    pool files inside its own ``pool_dir()``: the cluster's directory. It is created mode 0700, and one that
    another user made first (or a link) is refused with ``RuntimeError`` (``kvstore.private_dir``)."""
    directory = pool_dir_path()
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
    return (
        f"the KV pool needs {_mib(nbytes)} but the filesystem of {directory} has {_mib(available)} free"
        f"{held}: keeping the pool in private memory instead, so prefill workers on this host send its KV "
        "over gRPC, not through shared memory. To share it, give that filesystem room (Docker: --shm-size, "
        f"compose: shm_size; or {SHM_DIR_ENV} on a larger tmpfs) or make the pool smaller (--num-blocks, "
        "--kv-cache-memory-bytes); a decode worker's --no-shm keeps it private without this warning"
    )


def create_shared_pool(spec: KVCacheSpec, num_blocks: int, name: str) -> tuple[KVCache, Path | None]:
    """A KV pool whose bytes live in a new shared-memory file readable and writable by this user only.

    When the pool does not fit the free space of that file's filesystem (``_pool_space_shortfall``) it is
    made in private memory instead, with a warning, and the path returned is None: nobody maps it then.
    """
    directory = pool_dir()
    shortfall = _pool_space_shortfall(directory, spec.total_bytes(num_blocks))
    if shortfall is not None:
        log.warning(shortfall)
        return KVCache(spec, num_blocks, "cpu"), None
    path = _new_pool_file(directory / pool_file_name(name, os.getpid()), spec.total_bytes(num_blocks))
    return map_pool_file(spec, num_blocks, path), path


def create_part_files(specs: list[KVCacheSpec], num_blocks: int, name: str) -> list[Path]:
    """New pool files (as ``create_shared_pool``'s) for the parts of a pool split over tensor-parallel ranks
    1.. (``specs``: each part's), named ``kvserve-<name>-r<rank>-<pid>``: each rank maps its own, and rank 0
    maps them all (``kvstore.split_pool``). ``RuntimeError`` when they do not fit the filesystem's free space:
    unlike a whole pool, a part cannot fall back to private memory, since rank 0 must reach it."""
    directory = pool_dir()
    nbytes = sum(spec.total_bytes(num_blocks) for spec in specs)
    shortfall = _pool_space_shortfall(directory, nbytes)
    if shortfall is not None:
        raise RuntimeError(f"tensor parallel ranks on the CPU keep their KV in shared memory: {shortfall}")
    return [_new_pool_file(directory / pool_file_name(f"{name}-r{rank}", os.getpid()), spec.total_bytes(num_blocks))
            for rank, spec in enumerate(specs, start=1)]  # fmt: skip


def _new_pool_file(path: Path, nbytes: int) -> Path:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def map_pool_file(spec: KVCacheSpec, num_blocks: int, path: str | Path) -> KVCache:
    """Map a pool file (this process's or another's); writes go straight into every process that maps it.
    ``ValueError`` when the file's size is not that of ``num_blocks`` blocks of ``spec``."""
    nbytes = spec.total_bytes(num_blocks)
    actual = os.stat(path).st_size
    if actual != nbytes:
        raise ValueError(f"shared KV pool {path} has {actual} bytes, expected {nbytes}: layouts differ")
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return KVCache(spec, num_blocks, "cpu", buffer=buffer)
