"""Where a prefill worker's KV goes: one opened transport (``transfer.interface.KVTransport``) per decode worker's pool,
and the leases it ends in Redis once it will never write under them.

Transports are opened on the gRPC event loop, once per pool (``KVTransport.key``); leases are ended by a
thread of their own, so the batcher never waits on Redis.

A transport is closed once its decode worker is gone, for a dead worker's mapped pool pins its whole size in
memory (a removed file's pages stay while anyone maps it) and every restart makes a new one
(``kvstore.shared_pool.pool_file_name``):

* the transport says so (``gone``; ``shm``: its file was removed). The supervisor removes a dead decode
  worker's pool file, a stopping worker its own, and a standalone worker its dead predecessors';
* a newer pool of the same decode worker id arrives (it was restarted).

Every lookup looks, and so does the batcher after every turn (at most once per ``SWEEP_S``), so pools close
while no request comes too. Closing drops only our reference: a job still writing there (and the engine's
sequence for it) holds the pool, and its mapping ends with the last of them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cluster_state.registry import Registry
from kvstore.kv_cache import KVCacheSpec
from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import Security
from transfer.interface import KVTransport, Origin
from transfer.registry import transport_class

SWEEP_S = 1.0  # the batcher looks for transports whose decode worker is gone at most this often

log = logging.getLogger(__name__)


class Destinations:
    def __init__(self, spec: KVCacheSpec, fingerprint: str, worker_id: str, security: Security,
                 registry: Registry | None, device: torch.device) -> None:  # fmt: skip
        self.origin = Origin(spec, fingerprint, worker_id, security)
        self.registry = registry
        self.device = device
        self._open: dict[str, KVTransport] = {}  # by key, under _lock: the event loop opens, the batcher closes too
        self._lock = threading.Lock()
        self._next_sweep = 0.0
        self._lease_ends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-ends")

    def close(self) -> None:
        self._lease_ends.shutdown(wait=False)
        with self._lock:
            for key in list(self._open):
                self._close(key, "the prefill worker stops")

    def open(self, dest: pb.KVDestination) -> KVTransport:
        """The transport to ``dest``'s pool, opened once per pool. Raises ``transfer.interface.UnknownBackend``
        for a backend not served here, ``OSError``/``RuntimeError``/``ValueError`` when the pool cannot be
        opened."""
        transport = transport_class(dest.backend)
        key = transport.key(dest)
        with self._lock:
            self._close_gone()
            if key not in self._open:
                opened = transport.open(dest, self.origin)
                for older in [k for k, t in self._open.items() if t.worker_id == dest.worker_id]:
                    self._close(older, "a newer pool of the same decode worker arrived: it was restarted")
                self._open[key] = opened
            return self._open[key]

    def close_gone_pools(self) -> None:
        """Close the transports whose decode worker is gone, at most once per ``SWEEP_S``: the batcher calls
        this after every turn, so they close while no request comes too."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        with self._lock:
            self._close_gone()

    def _close_gone(self) -> None:
        for key in [key for key, transport in self._open.items() if transport.gone()]:
            self._close(key, "its decode worker is gone")

    def _close(self, key: str, reason: str) -> None:
        """Forget the transport ``key``: a pool it mapped is unmapped once no job holds it any more."""
        transport = self._open.pop(key)
        transport.close()
        log.info("closed decode worker %s's KV transport %s: %s", transport.worker_id, key, reason)

    def end_lease(self, request_id: str, state: str) -> None:
        """End our lease for ``request_id`` (``success`` or ``failed``): we will never write under it again
        (the batcher's thread calls this). On a GPU the copies are still queued on the stream, so the Redis
        thread waits for them first."""
        if self.registry is None:
            return
        written = None
        if self.device.type == "cuda":
            written = torch.cuda.Event()
            written.record()

        def end() -> None:
            if written is not None:
                written.synchronize()
            self.registry.end_lease(request_id, self.origin.worker_id, state)

        self._lease_ends.submit(end)
