"""The one interface through which a prefill worker reaches a decode worker's KV pool: ``KVTransport``.

A hand-off of one prompt's KV into the blocks a lease grants (the lease decides which blocks, never the
transport):

1. while the engine computes the prompt, its KV connector (``prefill_service.handoff``) copies each step's
   blocks into the transport's ``pool`` when it has one: the decode worker's own memory, mapped here
   (``shm``, ``cuda_ipc``);
2. once the prompt is done, before the engine releases our own blocks, ``take`` gets from them what the
   transport still has to move (``grpc``: their bytes; nothing when the pool was written in place) or moves
   them itself (``nixl``: one write into the leased blocks, waited for: the writer's lease then ends);
3. ``finish`` (a coroutine on the gRPC event loop) completes the hand-off and returns the checksum of the
   destination blocks (``transfer.blocks.checksum_blocks``), which the decode worker compares with its own.

A transport is opened once per decode worker's pool (``key``) and kept until that worker is gone (``gone``)
or a newer pool of it arrives: ``prefill_service.destinations`` keeps them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from kvstore.kv_cache import KVCacheSpec
from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import Security
from transfer.backend import Backend
from transfer.blocks import checksum_blocks


class UnknownBackend(ValueError):
    """The destination names a transport this worker does not serve."""


class TransferFailed(RuntimeError):
    """The KV could not be handed to the decode worker (it is unreachable, or refused it)."""


@dataclass(frozen=True)
class Origin:
    """The prefill worker's side of every transport it opens: its KV layout (the unsplit pool's, whatever either
    side's tensor-parallel split), and who it is to decode workers."""

    spec: KVCacheSpec
    fingerprint: str
    worker_id: str
    security: Security


class KVTransport(ABC):
    """One decode worker's pool as this prefill worker reaches it (see the module's docstring)."""

    backend: ClassVar[Backend]

    def __init__(self, worker_id: str, pool: SplitPool | None = None) -> None:
        self.worker_id = worker_id  # the decode worker whose pool this reaches
        self.pool = pool  # that pool, mapped here and written in place; None when the KV moves after the step

    @staticmethod
    @abstractmethod
    def key(dest: pb.KVDestination) -> str:
        """Names the pool ``dest`` reaches: destinations with equal keys share one opened transport."""

    @classmethod
    @abstractmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> KVTransport:
        """Reach ``dest``'s pool; ``OSError``, ``RuntimeError`` or ``ValueError`` when it cannot be opened."""

    def take(self, source: SplitPool, block_ids: list[int], request_id: str = "", dst_blocks: list[int] = (),
             deadline: float | None = None) -> object:  # fmt: skip
        """What ``finish`` needs from ``block_ids`` of our own pool, taken before the engine releases them
        (``nixl`` writes them into ``dst_blocks`` here, for ``request_id``, until ``deadline``)."""
        return None

    @abstractmethod
    async def finish(self, request_id: str, dst_blocks: list[int], taken: object) -> str:
        """Complete ``request_id``'s hand-off into ``dst_blocks`` (``taken``: what ``take`` returned) and return
        the checksum of those blocks; ``TransferFailed`` when the decode worker cannot be reached."""

    def gone(self) -> bool:
        """Whether the decode worker behind this transport is known to be gone."""
        return False

    def close(self) -> None:  # noqa: B027 - most transports hold nothing of their own
        """Let go of what only this transport holds; a job still writing into ``pool`` keeps it mapped."""


class InPlaceTransport(KVTransport):
    """A transport whose ``pool`` is the decode worker's memory: the KV is there once the engine has stored
    it, and ``finish`` only checksums the destination blocks (off the event loop)."""

    pool: SplitPool

    async def finish(self, request_id: str, dst_blocks: list[int], taken: object) -> str:
        return await asyncio.to_thread(checksum_blocks, self.pool, dst_blocks)
