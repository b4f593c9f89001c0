"""Which transport carries a prompt's KV from a prefill worker to a decode worker: ``choose_backend``.

The decode worker chooses, per prefill worker, once it has picked one, from what both advertise (host and
device in the registry; whether its own pool lives in a shared-memory file) and puts the choice in the
lease's ``KVDestination.backend``; the prefill worker opens the transport it names (``transfer.transport_class``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Backend(StrEnum):
    """A transport, named by its wire string: the value travels in ``KVDestination.backend``, in usage's
    ``transfer_backend`` and in metric labels, so a value never changes once released."""

    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    GRPC = "grpc"

    @property
    def writes_in_place(self) -> bool:
        """Whether the prefill worker writes (and may read) the decode worker's blocks itself, through a
        mapping of its pool, rather than through a receiver of the decode worker that checks the lease on
        every write (``grpc``: ``PushKV``). Only then may the lease offer cached prefix blocks to read, and
        only then must the writer end its lease itself: a revoked lease does not stop a write in flight."""
        return self in (Backend.SHM, Backend.CUDA_IPC)


# What usage's ``transfer_backend`` reports when no transport carried the KV: the decode worker prefilled the
# prompt itself. Not a ``Backend``: no ``KVDestination`` may name it, and nothing chooses or opens it.
LOCAL = "local"


@dataclass(frozen=True)
class Endpoint:
    """What a worker advertises that the choice of transport depends on."""

    host_id: str  # ``cluster_state.workers.local_host_id``: equal ids share memory (/dev/shm) and GPUs
    device: str  # its KV pool's device: "cpu", "cuda", "cuda:1"
    shm_pool: bool = False  # its pool lives in a shared-memory file others on the host may map


def choose_backend(prefill: Endpoint, decode: Endpoint, forced: Backend | None = None) -> Backend:
    """The transport from ``prefill`` into ``decode``'s pool:

    =========  ==================  ============
    same host  decode pool         transport
    =========  ==================  ============
    yes        on a GPU            ``cuda_ipc``
    yes        shared-memory file  ``shm``
    yes        private CPU memory  ``grpc``
    no         any                 ``grpc``
    =========  ==================  ============

    ``forced`` (a decode worker's ``--transfer-backend``) wins over the table, even where it cannot work:
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
