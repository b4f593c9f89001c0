"""The transports this build serves, by the backend name a ``KVDestination`` carries."""

from __future__ import annotations

from transfer.cuda_ipc import CudaIpcTransport
from transfer.grpc_stream import GrpcTransport
from transfer.interface import KVTransport, UnknownBackend
from transfer.nixl import NixlTransport
from transfer.shm import ShmTransport

TRANSPORTS: dict[str, type[KVTransport]] = {
    t.backend: t for t in (ShmTransport, CudaIpcTransport, GrpcTransport, NixlTransport)
}


def transport_class(backend: str) -> type[KVTransport]:
    """The transport a destination's ``backend`` names; ``UnknownBackend`` for one not served here."""
    transport = TRANSPORTS.get(backend)
    if transport is None:
        raise UnknownBackend(f"transfer backend {backend!r} is not served here")
    return transport
