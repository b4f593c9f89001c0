"""The directories a local cluster keeps on the host, held while their launcher lives and removed once it died.

A ``kvserve up`` keeps its decode workers' shared-memory KV pools and its embedded Redis's unix socket
(``redis-<launcher pid>.sock``) in ``kvserve-<uid>-cluster-<port>`` (under /dev/shm, else the temp
directory), and its embedded Redis keeps its config, log and pid file in a ``kvserve-redis-*`` scratch
directory in the temp directory. A SIGKILLed launcher cleans neither up.

Each such directory is *held*: its owner keeps it open with a shared ``flock`` for as long as it lives. The
kernel drops the lock when the owner exits, however it exits, and a process that later reuses the owner's
pid does not hold it, so "nobody holds the lock" is exact where a pid file is a guess. Shared, because two
clusters on one port (on different host addresses) share one pool directory.

``remove_dead_clusters``, which every ``kvserve up`` runs at its start, removes every such directory of this
user that nobody holds, taking an exclusive lock on it first (no owner can hold it meanwhile, and one that
was about to finds it gone and makes it again: see ``kvstore.private_dir.hold_dir``). A directory nobody
holds is still kept while it names a live process (a ``server.pid`` file, or a pool file
``kvserve-<worker>-<pid>``): that is a cluster of an older kvserve, which held nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from kvstore.private_dir import HeldDir, hold_dir, is_still, open_own_dir
from kvstore.shared_pool import SHM_ROOT, pool_file_pid

REDIS_DIR_PREFIX = "kvserve-redis-"
PID_FILE = "server.pid"  # the pid of the process a scratch directory serves (the embedded Redis's)


def cluster_shm_dir(port: int) -> Path:
    """Where the cluster on ``port`` keeps its KV pools (``hold_dir`` creates it)."""
    return _shm_root() / f"kvserve-{os.getuid()}-cluster-{port}"


def new_redis_dir() -> HeldDir:
    """A new, held scratch directory for an embedded Redis server."""
    return hold_dir(Path(tempfile.mkdtemp(prefix=REDIS_DIR_PREFIX)))


def remove_dead_clusters() -> list[Path]:
    """Remove this user's pool and Redis scratch directories that no live launcher holds, whichever port their
    cluster ran on; returns the removed paths. Other users' directories are never touched."""
    candidates = [*_shm_root().glob(f"kvserve-{os.getuid()}-cluster-*"),
                  *Path(tempfile.gettempdir()).glob(f"{REDIS_DIR_PREFIX}*")]  # fmt: skip
    return [path for path in candidates if remove_if_abandoned(path)]


def remove_if_abandoned(path: Path) -> bool:
    """Remove the directory ``path`` with everything in it when it is this user's, nobody holds it and it
    names no live process; returns whether it did."""
    fd = open_own_dir(path)
    if fd is None:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held by a live owner
        if not is_still(path, fd) or _names_live_process(path):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """True while process ``pid`` runs; a zombie (exited, not yet reaped) does not count."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # it exists, but we may not read it: count it as alive
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _shm_root() -> Path:
    return SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())


def _names_live_process(path: Path) -> bool:
    pids = []
    for entry in path.iterdir():
        if entry.name == PID_FILE:
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(entry.read_text()))
        elif (pid := pool_file_pid(entry.name)) is not None:
            pids.append(pid)
    return any(process_alive(pid) for pid in pids)
