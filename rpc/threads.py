"""A compute worker's share of the host's cores."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_compute_threads(threads: int | None, num_workers_on_host: int, leased: bool = False) -> int:
    """Give torch ``threads`` intra-op threads (``--threads``, validated at least 1), by default this
    process's share of the host's cores, or all of them for a worker that computes only while it holds the
    host's compute lease (``leased``: ``rpc.compute_lease``).

    Every worker process would otherwise start one OpenMP thread per core; four workers on two cores
    then spend their time preempting each other (measured: 7-16x slower under load).
    """
    share = threads or (host_cores() if leased else max(1, host_cores() // max(1, num_workers_on_host)))
    torch.set_num_threads(share)
    log.info("torch compute threads: %d (%d cores, %d compute workers on this host)", share, host_cores(),
             num_workers_on_host)  # fmt: skip
    return share
