"""Which transport carries a prompt's KV from a prefill worker to a decode worker: ``choose_backend``.

The decode worker chooses, per prefill worker, once it has picked one, from what both advertise (host,
device and offered transports in the registry; whether its own pool lives in a shared-memory file) and puts
the choice in the lease's ``KVDestination.backend``; the prefill worker opens the transport it names
(``transfer.registry.transport_class``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import StrEnum


class Backend(StrEnum):
    """A transport, named by its wire string: the value travels in ``KVDestination.backend``, in usage's
    ``transfer_backend``, in metric labels and in a worker's offered ``transports``, so a value never changes
    once released."""

    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    GRPC = "grpc"
    NIXL = "nixl"

    @property
    def writes_in_place(self) -> bool:
        """Whether the prefill worker writes the decode worker's blocks itself (a mapping of its pool, or a
        NIXL write into its registered pool) rather than through a receiver of the decode worker that checks
        the lease on every write (``grpc``: ``PushKV``). Then the writer must end its lease itself, and the
        decode worker quarantines the blocks of a failed call until it has: a revoked lease does not stop a
        write in flight."""
        return self is not Backend.GRPC

    @property
    def maps_pool(self) -> bool:
        """Whether the prefill worker maps the decode worker's pool (``shm``, ``cuda_ipc``): only then may a
        lease offer cached prefix blocks to read in place."""
        return self in (Backend.SHM, Backend.CUDA_IPC)


# What usage's ``transfer_backend`` reports when no transport carried the KV: the decode worker prefilled the
# prompt itself. Not a ``Backend``: no ``KVDestination`` may name it, and nothing chooses or opens it.
LOCAL = "local"



def nixl_installed() -> bool:
    """Whether NIXL is installed here, found without importing it or torch (importing and starting it costs
    seconds): what a worker offers in its registration, and what ``--kv-transport nixl`` needs."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))

@dataclass(frozen=True)
class Endpoint:
    """What a worker advertises that the choice of transport depends on."""

    host_id: str  # ``cluster_state.workers.local_host_id``: equal ids share memory (/dev/shm) and GPUs
    device: str  # its KV pool's device: "cpu", "cuda", "cuda:1"
    shm_pool: bool = False  # its pool lives in a shared-memory file others on the host may map
    transports: frozenset[str] = frozenset()  # what it offers beyond grpc (``WorkerInfo.transports``): "nixl"


def choose_backend(prefill: Endpoint, decode: Endpoint, forced: Backend | None = None) -> Backend:
    """The transport from ``prefill`` into ``decode``'s pool:

    =========  ==================  ===================  ============
    same host  decode pool         both offer ``nixl``  transport
    =========  ==================  ===================  ============
    yes        on a GPU            any                  ``cuda_ipc``
    yes        shared-memory file  any                  ``shm``
    yes        private CPU memory  any                  ``grpc``
    no         any                 yes                  ``nixl``
    no         any                 no                   ``grpc``
    =========  ==================  ===================  ============

    ``forced`` (a decode worker's ``--kv-transport``) wins over the table, even where it cannot work:
    the prefill worker then refuses the call and the decode worker prefills locally.
    """
    if forced is not None:
        return forced
    if prefill.host_id == decode.host_id:
        if decode.device.startswith("cuda"):
            return Backend.CUDA_IPC
        if decode.shm_pool:
            return Backend.SHM
        return Backend.GRPC
    if Backend.NIXL in prefill.transports and Backend.NIXL in decode.transports:
        return Backend.NIXL
    return Backend.GRPC
