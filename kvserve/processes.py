"""Child processes that never outlive the launcher that started them."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: the kernel SIGKILLs the child when its parent dies, however the
    parent dies (SIGKILL included), so a killed launcher leaves no orphans holding ports or shared memory."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
