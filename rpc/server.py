"""Server set-up every kvserve process shares: a ``grpc.aio`` server with the token interceptor, TLS when
configured, health checking and reflection; and the wait for a peer to become healthy.

Every service is served by ``grpc.aio``: a streaming ``Generate`` holds a coroutine, not a thread, so
thousands of open streams never starve ``PushKV`` or a new call (a thread pool of 32 did).
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import GRPC_OPTIONS, Security

SERVICES = ("Inference", "Decode", "Prefill", "KVTransfer")


def new_server(security: Security) -> grpc.aio.Server:
    """A ``grpc.aio`` server (create it on the event loop that will run it)."""
    return grpc.aio.server(interceptors=security.interceptors(), options=GRPC_OPTIONS)


def add_service(server: grpc.aio.Server, name: str, servicer: object) -> str:
    """Register ``servicer`` for ``kvserve.v1.{name}``; returns the full service name."""
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {SERVICES}")
    getattr(pb_grpc, f"add_{name}Servicer_to_server")(servicer, server)
    return f"kvserve.v1.{name}"


async def start_server(
    server: grpc.aio.Server, service_names: list[str], address: str, security: Security
) -> tuple[int, health.aio.HealthServicer]:
    """Add health checking and reflection, bind ``address`` and start; returns (port, health servicer)."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = security.bind(server, address)
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return port, health_servicer


async def set_not_serving(health_servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    """Tell health checkers (routers, the launcher) to stop sending new work: the process is draining."""
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def wait_healthy(address: str, timeout_s: float, security: Security | None = None) -> bool:
    """True once ``address`` answers SERVING to a health check within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with (security or Security.insecure()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False
