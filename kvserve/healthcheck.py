"""``python -m kvserve.healthcheck HOST:PORT [--timeout S] [security flags]``: exit 0 when the kvserve process
on HOST:PORT answers SERVING to a gRPC health check, 1 otherwise (a draining worker answers NOT_SERVING).

Container healthchecks run it (docker-compose.yml). It holds the cluster member's credentials as workers do
(``KVSERVE_CLUSTER_TOKEN_FILE`` or ``KVSERVE_CLUSTER_TOKEN``, and ``--tls-*`` where ports use TLS), so it
still answers right if the health service is ever closed to outsiders.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field

from rpc.options import SecuritySettings
from rpc.settings import parse_settings
from security.auth import Security, security_from_settings


def health_status(address: str, timeout_s: float, security: Security) -> str:
    """The status ``address`` answers (``SERVING``, ``NOT_SERVING``, ...), or the gRPC error that came instead."""
    with security.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=security.metadata(), wait_for_ready=True
            )
        except grpc.RpcError as err:
            return f"{err.code().name} ({err.details()})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class HealthcheckSettings(SecuritySettings):
    """health check"""

    address: str = Field(description="HOST:PORT of a router, decode or prefill worker")
    timeout: float = Field(3.0, gt=0, description="seconds to wait for the answer")


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(HealthcheckSettings, argv, "python -m kvserve.healthcheck", __doc__)
    try:
        security = security_from_settings(args)
    except ValueError as err:
        sys.exit(f"healthcheck: {err}")
    status = health_status(args.address, args.timeout, security)
    if status != "SERVING":
        sys.exit(f"healthcheck: {args.address}: {status}, not SERVING")
    print(f"{args.address} SERVING")


if __name__ == "__main__":
    main()
