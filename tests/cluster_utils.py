"""Starting real local clusters for the service tests."""

from __future__ import annotations

import random
import socket

from kvserve.cluster import start_cluster


def free_base_port() -> int:
    """A base port with the router's port and the worker ports after it (base+10.., base+30..) all free."""
    for _ in range(50):
        base = random.randrange(20000, 60000, 100)
        ports = [base, *range(base + 10, base + 14), *range(base + 30, base + 34)]
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range found")


def cluster(num_prefill: int, num_decode: int, log_dir, decode_argv=None, prefill_argv=None):
    return start_cluster(
        num_prefill=num_prefill,
        num_decode=num_decode,
        port=free_base_port(),
        engine_argv=["--model", "default", "--num-blocks", "256", "--block-size", "16"],
        decode_argv=decode_argv,
        prefill_argv=prefill_argv,
        log_dir=str(log_dir),
    )
