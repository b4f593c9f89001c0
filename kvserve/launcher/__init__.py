"""The local cluster: ``cluster`` plans and starts it (``kvserve up``), ``supervisor`` restarts what dies,
``processes``/``child_process`` start children that die with their parent, ``scratch`` owns the cluster's private
directories, ``redis_server``/``redis_binary`` the embedded Redis.

The launcher starts children with fork + exec from a process that already runs gRPC threads; gRPC's fork
handlers then abort the child between the two (SIGABRT, "epoll_wait error: Bad file descriptor"). Nothing here
uses gRPC across a fork, so they stay off. It must be set before grpc loads: ``kvserve.cli`` imports this package
before anything else.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
