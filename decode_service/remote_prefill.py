"""The decode worker's KV connector: a request's prompt KV comes from a prefill worker.

The engine's scheduler admits the request (it owns the waiting queue and the blocks); this connector says
whether its prompt is loaded from outside and does the loading:

* ``num_external_tokens``: a queued request is prefilled remotely when a live, untried prefill worker with
  our layout exists and the ``DisaggPolicy`` says a hand-off pays (every token after our cached prefix comes
  from there, asynchronously); otherwise it is computed here, by the engine's own chunked prefill
  (``local``).
* ``after_allocate``: its blocks are allocated: lease those after our cached prefix to the prefill worker
  and call its ``Prefill`` (PREFILLING). A prefill worker that maps our pool may read the cached prefix
  blocks in place (``prefill_reads_cached_prefix``).
* ``finished_loads``: a call that answered with a checksum matching our blocks makes the request run with
  the prefill worker's first token (RUNNING); over ``nixl`` only once that writer's NIXL notification for
  the request has arrived too (the write is complete in our memory: ``transfer.nixl``). A failed, expired
  or mismatched one sends it back to the waiting queue (QUEUED), to be tried on another prefill worker,
  then locally; blocks its writer may still touch are first quarantined (``prefill_client.Quarantine``:
  renamed in the block manager, so the engine frees only the rest). A ``nixl`` hand-off we chose (not
  forced) that fails marks that prefill worker as unreachable over NIXL (logged once) and retries the
  request there over ``grpc``.
* ``request_finished``: a request that ends while its prefill is in flight cancels the call and
  quarantines its blocks the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_service.disaggregation import Decision, DisaggPolicy
from decode_service.prefill_client import PrefillClient, Quarantine
from decode_service.request import ActiveRequest, Admission, RequestState
from engine.kv_connector import FinishedLoad, KVConnector
from engine.sequence import Sequence
from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc import metrics
from rpc.convert import logprobs_from_proto
from transfer.backend import LOCAL, Backend, Endpoint, choose_backend
from transfer.nixl_agent import NixlOffer

log = logging.getLogger(__name__)
S = RequestState


@dataclass(frozen=True)
class PoolOffer:
    """What this decode worker tells a prefill worker about its pool, in every lease."""

    worker_id: str
    address: str
    fingerprint: str
    endpoint: Endpoint
    num_blocks: int
    shm_path: str = ""
    cuda_ipc_handle: bytes = b""
    kv_heads: str = ""  # heads of each part when split over tensor-parallel ranks ("2,1"); '' for one part
    part_shm_paths: tuple[str, ...] = ()  # the files of parts 1.. (``shm_path`` is part 0's)
    part_cuda_ipc_handles: tuple[bytes, ...] = ()  # the exported pools of parts 1.. (each rank's own)


class RemotePrefillConnector(KVConnector):
    brings_logits = True  # the prefill worker computes what a request asks for (``_loaded``)

    def __init__(self, pool: PoolOffer, kv_cache: SplitPool, block_size: int, prefills: PrefillClient,
                 quarantine: Quarantine, admission: Admission, wake: Callable[[], None], revoke_lock: threading.Lock,
                 forced: Backend | None = None, offer_cached_prefix: bool = True,
                 nixl: NixlOffer | None = None, policy: DisaggPolicy | None = None,
                 prefilling_here: Callable[[], int] = lambda: 0) -> None:  # fmt: skip
        self.pool, self.kv_cache, self.block_size = pool, kv_cache, block_size
        self.prefills, self.quarantine, self.admission, self.wake = prefills, quarantine, admission, wake
        self.forced, self.offer_cached_prefix = forced, offer_cached_prefix
        self.in_flight: dict[str, ActiveRequest] = {}  # PREFILLING requests by id
        self.revoke_lock = revoke_lock  # PushKV holds it while it writes under a lease (``lease_holder``)
        self._failed_to_start: list[str] = []
        self.nixl = nixl  # our pool as NIXL peers reach it; None: NIXL is not installed here
        self.no_nixl: set[str] = set()  # prefill workers a nixl hand-off to failed: grpc from then on
        self._notified: set[tuple[str, str]] = set()  # (request id, writer) whose NIXL write completed
        self.policy = policy or DisaggPolicy()
        self.prefilling_here = prefilling_here  # prompts the engine is computing now (its own prefills)

    # -- scheduler side ----------------------------------------------------------------------------------

    def num_external_tokens(self, seq: Sequence, num_cached_tokens: int) -> tuple[int, bool]:
        req: ActiveRequest | None = seq.kv_params
        if req is None or req.state is not S.QUEUED:
            return 0, False  # already prefilled once (a preempted request is recomputed here)
        # what we hold: our prefix cache's hit plus what a connector before us (a memory tier) loads
        req.num_cached_tokens = num_cached_tokens
        uncached = seq.num_tokens - num_cached_tokens
        if seq.params.max_tokens == 0:
            decision, req.target = Decision.SCORE, None  # there is no decoding to hand it over for
        else:
            target = self.prefills.pick(req.tried, req.preferred_prefill)
            at_target = target.worker_id if target is not None else None
            ours = sum(1 for r in self.in_flight.values() if r.prefill_worker == at_target)
            decision = self.policy.decide(uncached, target, ours, self.prefilling_here())
            req.target = target if decision is Decision.REMOTE else None
        metrics.DISAGG_DECISIONS.labels(decision.value).inc()
        req.span.set(disagg_decision=decision.value, uncached_tokens=uncached)
        return (uncached, True) if req.target is not None else (0, False)


    def after_allocate(self, seq: Sequence, num_external_tokens: int) -> None:
        req: ActiveRequest | None = seq.kv_params
        if req is None or req.state is not S.QUEUED:
            return
        if not req.admitted:
            req.admitted, req.admitted_at = True, time.perf_counter()
            self.admission.leave()
        req.block_ids = seq.block_table.tolist()
        if not num_external_tokens:
            req.move(S.RUNNING)
            req.backend, req.prefill_worker = LOCAL, ""
            return
        try:
            self._start(req)
        except Exception:  # noqa: BLE001 - this request only: it goes back to the queue and is tried elsewhere
            log.exception("starting the prefill of %s failed", req.request_id)
            if req.target.worker_id not in req.tried:
                req.tried.append(req.target.worker_id)
            self._failed_to_start.append(req.request_id)

    def _start(self, req: ActiveRequest) -> None:
        target, pool = req.target, self.pool
        offered = frozenset(target.transports.split(",")) - {"", *([Backend.NIXL] if target.worker_id in self.no_nixl
                                                                    else [])}  # fmt: skip
        backend = choose_backend(Endpoint(target.host_id, target.device, transports=offered), pool.endpoint,
                                 self.forced)  # fmt: skip
        nixl = self.nixl.ready() if backend == Backend.NIXL and self.nixl is not None else None
        if backend == Backend.NIXL and nixl is None and self.forced is None:
            backend = Backend.GRPC  # our agent is still starting
        timeout = self.prefills.timeout_for(len(req.tokens))
        req.move(S.PREFILLING)
        self.in_flight[req.request_id] = req
        req.backend, req.lease_deadline = backend, time.monotonic() + timeout
        held = req.block_ids[: req.num_cached_tokens // self.block_size]  # our cached prefix
        req.leased = req.block_ids[len(held) :]  # what the prefill worker writes
        # a worker that maps our pool may read ``held`` in place instead of computing it (we keep it allocated)
        offered = held if self.offer_cached_prefix and backend.maps_pool else []
        dest = pb.KVDestination(worker_id=pool.worker_id, backend=backend, address=pool.address,
                                fingerprint=pool.fingerprint, block_ids=req.leased, shm_path=pool.shm_path,
                                num_blocks=pool.num_blocks, cuda_ipc_handle=pool.cuda_ipc_handle,
                                cached_block_ids=offered, nixl_metadata=nixl.metadata if nixl else b"",
                                nixl_pool=nixl.pool if nixl else "", kv_heads=pool.kv_heads,
                                part_shm_paths=pool.part_shm_paths if backend == Backend.SHM else (),
                                part_cuda_ipc_handles=pool.part_cuda_ipc_handles if backend == Backend.CUDA_IPC
                                else ())  # fmt: skip
        self.prefills.start(req, target, dest, timeout)
        req.future.add_done_callback(lambda _: self.wake())

    def finished_loads(self) -> list[FinishedLoad]:
        loads = [FinishedLoad(rid, None) for rid in self._failed_to_start]
        for rid in self._failed_to_start:
            self._back_to_queue(self.in_flight.pop(rid, None), writer_done=True)
        self._failed_to_start = []
        now, notified = time.monotonic(), self._nixl_notifications()
        for req in [r for r in self.in_flight.values() if self._settled(r, now, notified)]:
            del self.in_flight[req.request_id]
            reply, error, writer_done = self.prefills.outcome(req, self.kv_cache, len(req.leased))
            if error is None and req.backend == Backend.NIXL and (req.request_id, req.prefill_worker) not in notified:
                error, writer_done = "the NIXL write's notification did not arrive before the lease ran out", False
            notified.discard((req.request_id, req.prefill_worker))
            if reply is not None:
                req.prefill_span.set(prefill_ms=reply.prefill_ms, transfer_ms=reply.transfer_ms,
                                     bytes=len(req.leased) * self.kv_cache.spec.bytes_per_block(),
                                     prefill_cached_tokens=reply.num_cached_tokens)  # fmt: skip
            req.prefill_span.end(error)
            if error is None:
                self.prefills.delete_lease(req.request_id, req.prefill_worker)
                req.prefill_ms, req.transfer_ms = reply.prefill_ms, reply.transfer_ms
                req.move(S.RUNNING)
                loads.append(_loaded(req, reply))
            else:
                log.warning("prefill of %s on %s failed (%s); retrying", req.request_id, req.prefill_worker, error)
                self._nixl_failed(req)
                self._back_to_queue(req, writer_done)
                loads.append(FinishedLoad(req.request_id, None))
        return loads

    def _nixl_notifications(self) -> set[tuple[str, str]]:
        """(request id, writer) of the NIXL writes completed so far for requests in flight."""
        pool = self.nixl.ready() if self.nixl is not None and any(
            r.backend == Backend.NIXL for r in self.in_flight.values()) else None  # fmt: skip
        for writer, rid in pool.arrived() if pool is not None else ():
            if rid in self.in_flight:  # a late one, for a request given up on, is dropped
                self._notified.add((rid, writer))
        return self._notified

    def _settled(self, req: ActiveRequest, now: float, notified: set[tuple[str, str]]) -> bool:
        """Whether ``req``'s load is over: its call ended (a successful ``nixl`` one once the notification
        arrived too), or its lease ran out."""
        if now >= req.lease_deadline or not req.future.done():
            return now >= req.lease_deadline
        ok = not req.future.cancelled() and req.future.exception() is None
        return not (ok and req.backend == Backend.NIXL) or (req.request_id, req.prefill_worker) in notified

    def _nixl_failed(self, req: ActiveRequest) -> None:
        """A ``nixl`` hand-off we chose failed: that prefill worker gets ``grpc`` from now on, this request
        included (it may be tried there again)."""
        if req.backend != Backend.NIXL or self.forced is not None or req.prefill_worker in self.no_nixl:
            return
        self.no_nixl.add(req.prefill_worker)
        log.warning("KV hand-offs to %s fall back to grpc: a nixl hand-off failed", req.prefill_worker)
        if req.prefill_worker in req.tried:
            req.tried.remove(req.prefill_worker)

    def _back_to_queue(self, req: ActiveRequest | None, writer_done: bool) -> None:
        if req is not None and req.state is S.PREFILLING:
            self._release(req, writer_done)
            req.move(S.QUEUED)

    def request_finished(self, seq: Sequence) -> bool:
        req: ActiveRequest | None = seq.kv_params
        if req is not None and self.in_flight.pop(req.request_id, None) is not None:
            req.future.cancel()  # the prefill worker drops the job and ends the lease
            self._release(req, writer_done=False)
        return False

    def _release(self, req: ActiveRequest, writer_done: bool) -> None:
        """Revoke ``req``'s lease; quarantine its blocks while its writer may still write (``shm``,
        ``cuda_ipc``: a ``grpc`` writer writes only through PushKV, which a revoked lease stops at once).
        What stays under the request's id the engine frees."""
        writer = req.prefill_worker
        with self.revoke_lock:
            req.prefill_worker = ""  # revoke: ``lease_holder`` names no one
        self._notified.discard((req.request_id, writer))
        if writer_done or req.backend == Backend.GRPC:
            self.prefills.delete_lease(req.request_id, writer)
        else:
            self.quarantine.hold(req.request_id, writer, req.prefill_address, req.lease_deadline)

    def lease_holder(self, request_id: str) -> tuple[list[int], str]:
        """(blocks, prefill worker) of a request whose prefill is in flight; ([], '') otherwise. For PushKV."""
        req = self.in_flight.get(request_id)
        return (req.leased, req.prefill_worker) if req is not None and req.prefill_worker else ([], "")


def _loaded(req: ActiveRequest, reply: pb.PrefillResponse) -> FinishedLoad:
    """The load a prefill worker's reply finished, with the log-probabilities it computed when asked."""
    logprob = logprobs_from_proto([reply.first_token_logprob])[0] if reply.HasField("first_token_logprob") else None
    prompt = logprobs_from_proto(reply.prompt_logprobs) if req.params.prompt_logprobs is not None else None
    return FinishedLoad(req.request_id, reply.first_token_id, logprob, prompt)
