"""What users touch: the ``kvserve`` command line, the client library (``Client``, ``AsyncClient``), the local
cluster launcher and the benchmarks (``kvserve.bench``)."""

import os

# The launcher (``kvserve up``) starts children with fork + exec from a process that already runs gRPC threads;
# gRPC's fork handlers then abort the child between the two (SIGABRT, "epoll_wait error: Bad file
# descriptor"). Nothing here uses gRPC across a fork, so they stay off; it must be set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from kvserve.client import AsyncClient, Client  # noqa: E402

__all__ = ["AsyncClient", "Client"]
