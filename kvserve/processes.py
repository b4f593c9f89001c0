"""Child processes that never outlive the launcher that started them."""

from __future__ import annotations

import ctypes
import signal
import sys

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
