"""Directories only this user may use: the shared-memory pool directories and a local cluster's scratch.

They sit at names anyone can predict (``/dev/shm/kvserve-<uid>``, ``kvserve-<uid>-cluster-<port>``) in
directories anyone may write (/dev/shm, /tmp), so another local user can make one first: a directory of
theirs, or a link to one. Whatever we then put there (KV pool files, Redis's socket and config) they could
read, replace or delete. So a directory is taken only when it is a real directory (not a link) owned by this
user with mode 0700, or when we create it ourselves; anything else is refused with ``RuntimeError``.

A directory can also be *held* (``hold_dir``): kept open with a shared ``flock`` for as long as its holder
lives, which is how ``kvserve.launcher.scratch`` tells a live cluster's directories from a dead one's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

_HOLD_ATTEMPTS = 10


class HeldDir:
    """A directory this process holds (a shared ``flock`` on it) until ``release`` or its exit."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Stop holding the directory (it stays); safe to call more than once."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def private_dir(path: Path) -> Path:
    """``path``, created mode 0700 unless it exists; raises ``RuntimeError`` unless it is a private directory
    of this user (``open_private_dir``)."""
    os.close(open_private_dir(path))
    return path


def open_private_dir(path: Path) -> int:
    """An open descriptor of the directory ``path``, created mode 0700 unless it exists. Raises
    ``RuntimeError`` when it is a link, not a directory, another user's, or open to other users."""
    created = False
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
        created = True
    fd = open_own_dir(path)
    if fd is None:
        raise RuntimeError(f"{path} is not a directory owned by this user (uid {os.getuid()}): someone else may "
                           "have made it to read or replace what kvserve keeps there; remove it")  # fmt: skip
    try:
        if created:
            os.fchmod(fd, 0o700)  # whatever the umask took away
        mode = os.fstat(fd).st_mode & 0o777
        if mode != 0o700:
            raise RuntimeError(f"{path} has mode {mode:04o}, not 0700: other users may have put files there; "
                               "remove it (or chmod 700 it if everything in it is yours)")  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold_dir(path: Path) -> HeldDir:
    """Create ``path`` (mode 0700) unless it exists, and hold it. Raises ``RuntimeError`` as
    ``open_private_dir`` does."""
    for _ in range(_HOLD_ATTEMPTS):
        fd = open_private_dir(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a clean-up that found it abandoned removes it
        except BaseException:
            os.close(fd)
            raise
        if is_still(path, fd):
            return HeldDir(path, fd)
        os.close(fd)  # a clean-up removed it between our mkdir and our lock: make it again
    raise RuntimeError(f"{path} was removed {_HOLD_ATTEMPTS} times while we tried to hold it")


def open_own_dir(path: Path) -> int | None:
    """An open descriptor of ``path`` when it is a directory (not a link to one) owned by this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    if os.fstat(fd).st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def is_still(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the directory open as ``fd`` (not removed, nor replaced, since)."""
    try:
        now, opened = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)
