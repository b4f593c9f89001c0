"""What a launcher asks of the operating system about its child processes: that they die with it, how one
ended, and whether something listens on a port.

A leaf: it imports nothing of ours, so the supervisor, the child wrappers (``kvserve.launcher.processes``) and the
embedded Redis (``kvserve.launcher.redis_server``) all build on it without importing each other.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

LISTEN_PROBE_S = 0.5

_PR_SET_PDEATHSIG = 1
# Resolved now, in the parent: between fork and exec the child may only make simple calls (a dlopen there
# can deadlock on a lock another thread of the parent held at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: the kernel SIGKILLs the child when its parent dies, however the
    parent dies (SIGKILL included), so a killed launcher leaves no orphans holding ports or shared memory.
    The kernel counts the *thread* that started the child as its parent: start children from a thread that
    lives as long as they should (``kvserve up`` starts them all from its main thread)."""
    if _prctl is not None and _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def describe_exit(returncode: int) -> str:
    """A ``Popen.returncode`` in words: "exited with code 1", or "killed by SIGKILL" for a negative one."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def listens(host: str, port: int) -> bool:
    """Whether some process accepts TCP connections on ``host:port`` now."""
    try:
        socket.create_connection((host.strip("[]"), port), timeout=LISTEN_PROBE_S).close()
    except OSError:
        return False
    return True
