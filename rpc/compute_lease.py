"""Turns on a host's cores for the compute workers that share them (``--compute-lease PATH``).

Splitting the cores statically (``--threads`` = cores / workers) leaves half a 2-core host idle whenever one
role has nothing to do: with one user, a request's prefill and its decode never run at the same time, yet
each ran on one core. With a lease, every worker on the host runs torch on all the cores, and holds the lease
for each engine step: one worker computes at a time, and a worker with nothing to run holds no core. Two busy
OpenMP pools never share the cores (oversubscribed, each would be slower than one alone), and an idle pool's
threads sleep rather than spin once another process takes the cores (``rpc.loop``'s note on libgomp).

Safe under load: the lease is fair. It is two ``flock`` locks on files next to ``PATH``: a worker queues on
``PATH.queue``, then waits for ``PATH.turn`` and leaves the queue once it has the turn. A worker that just
finished a step finds the next one in the queue holding ``.queue``, so it waits behind it: busy workers
alternate step by step, and neither role starves the other (a decode step and a prefill step alternate, as
they would inside one engine that mixes them). A process that dies holding a lock loses it with its file
descriptors. The cost without contention is four system calls a step.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from prometheus_client import Counter

LEASE_WAIT = Counter("kvserve_compute_lease_wait_seconds", "Time engine steps waited for the host's compute "
                     "lease (--compute-lease): another worker was computing on the shared cores", ["role"])  # fmt: skip


class ComputeLease:
    """A context manager held around each engine step; ``ComputeLease(None)`` (no ``--compute-lease``) is free."""

    def __init__(self, path: str | None, role: str = "") -> None:
        self.path = path
        self._queue = self._turn = -1
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._queue = os.open(f"{path}.queue", os.O_RDWR | os.O_CREAT, 0o600)
            self._turn = os.open(f"{path}.turn", os.O_RDWR | os.O_CREAT, 0o600)
        self._waited = LEASE_WAIT.labels(role)

    def __enter__(self) -> ComputeLease:
        if self.path is not None:
            asked = time.perf_counter()
            fcntl.flock(self._queue, fcntl.LOCK_EX)
            fcntl.flock(self._turn, fcntl.LOCK_EX)
            fcntl.flock(self._queue, fcntl.LOCK_UN)
            self._waited.inc(time.perf_counter() - asked)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            fcntl.flock(self._turn, fcntl.LOCK_UN)
