"""A request's life on the decode worker (decode allocates first, prefill pushes); states in ``request.py``:

1. ``Generate`` (a coroutine on the gRPC event loop) validates the request (a continuation of a stream
   another worker began included) and hands it to the engine loop, which adds it to the engine (QUEUED);
   past ``max_waiting`` requests not yet holding blocks: RESOURCE_EXHAUSTED, while draining: UNAVAILABLE
   (the router retries elsewhere).
2. The engine's scheduler admits it when its blocks fit (a request that does not fit lets smaller ones
   pass, ``engine.scheduler``). The KV connector (``remote_prefill``) then calls a prefill worker's
   ``Prefill`` with the blocks after our cached prefix under a signed lease (PREFILLING; the scheduler's
   WAITING_FOR_REMOTE_KV); with no prefill worker, or where a hand-off would not pay (few uncached tokens,
   every prefill worker's queue long: ``disaggregation.DisaggPolicy``), the engine prefills it here
   (RUNNING).
3. The prefill worker writes the KV into those blocks (``shm``: in place; ``grpc``: ``KVReceiver.PushKV``)
   and answers with the first token and a checksum, which the connector verifies against our blocks: the
   request runs (RUNNING). A failed prefill is retried on another prefill worker, then locally; blocks its
   writer may still touch are quarantined until it ends the lease, or the lease's expiry plus a grace
   (``prefill_client.Quarantine``).
4. Every step's tokens go to the request's stream; a request of ``n`` choices (``engine.parallel_sampling``)
   streams them interleaved, each message with its choice's ``index``, and only choice 0 is prefilled
   remotely: the others share its prompt's blocks once they arrived. Every exit (FINISHED, ABORTED by a gone
   client, FAILED) goes through ``_finish``, which aborts it in the engine (the connector cancels a prefill in
   flight) and ends the stream; a loop error fails only the requests it concerns. SIGTERM drains: no admissions, queued
   requests handed back (UNAVAILABLE), running ones finish within the drain timeout, and what still runs
   then ends with UNAVAILABLE, which the router turns into a continuation on another decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import time
import uuid

import grpc

from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo, local_host_id
from decode_service.disaggregation import DisaggPolicy
from decode_service.prefill_client import PrefillClient, Quarantine
from decode_service.remote_prefill import PoolOffer, RemotePrefillConnector
from decode_service.request import ActiveRequest, Admission, RequestState, validate_decode_request
from engine import LLMEngine, RequestOutput
from engine.outputs import StepError
from kvstore.ipc_pool import export_cuda_ipc
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc import tracing
from rpc.compute_lease import ComputeLease
from rpc.loop import AsyncioThread, Loop
from security.auth import Security
from transfer.backend import Backend, Endpoint, nixl_installed
from transfer.grpc_stream import KVReceiver
from transfer.nixl_agent import NixlOffer

log = logging.getLogger(__name__)
S = RequestState


class DecodeWorker(pb_grpc.DecodeServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, address: str, aio: AsyncioThread, security: Security,
                 registry: Registry | None = None, shm_path: str = "", max_waiting: int = 64,
                 prefill_timeout_s: float = 30.0, prefill_ms_per_token: float = 20.0,
                 kv_transport: str | None = None, prefill_reads_cached_prefix: bool = True,
                 compute: ComputeLease | None = None, disagg: DisaggPolicy | None = None) -> None:  # fmt: skip
        self.engine, self.worker_id, self.address, self.security = engine, worker_id, address, security
        self.compute = compute or ComputeLease(None)  # held around each step (rpc.compute_lease)
        runner = engine.runner
        self.fingerprint = engine.prefix_salt  # the KV layout, of all heads (the same for every TP size)
        # Tensor parallel: a prefill worker writes each rank's part its heads (``kvstore.split_pool``), through
        # the part files (shm) or each rank's exported pool (cuda_ipc), our receiver (grpc) or our NIXL agent,
        # which registers every part of a CPU worker's pool (a GPU rank's part is opened here through CUDA IPC,
        # and NIXL is not asked to register such memory)
        whole = runner.kv_pool
        nixl_reaches = not whole.ipc_parts
        if kv_transport == Backend.NIXL and not (nixl_reaches and nixl_installed()):
            raise RuntimeError("--kv-transport nixl needs NIXL (pip install 'kvserve[nixl]') and, split over "
                               "ranks, a CPU worker")  # fmt: skip
        eager = kv_transport == Backend.NIXL
        self.nixl = NixlOffer(whole, worker_id, eager) if nixl_installed() and nixl_reaches else None
        self.endpoint = Endpoint(local_host_id(), str(runner.device), bool(shm_path),
                                 frozenset([Backend.NIXL] if self.nixl else []))  # fmt: skip
        ipc = export_cuda_ipc(runner.kv_cache) if runner.device.type == "cuda" else b""
        self.kv_heads = runner.kv_heads  # advertised: what each rank holds
        parts = [str(p) for p in runner.kv_part_paths] if shm_path else []
        pool = PoolOffer(worker_id, address, self.fingerprint, self.endpoint, runner.num_blocks, shm_path, ipc,
                         self.kv_heads, tuple(parts), tuple(runner.kv_part_handles))  # fmt: skip
        self.prefills = PrefillClient(aio, security, worker_id, self.fingerprint, registry, prefill_timeout_s,
                                      prefill_ms_per_token)  # fmt: skip
        self.receiver = KVReceiver(whole, self.fingerprint, self.lease_holder)
        self.quarantine = Quarantine(engine.block_manager, self.prefills)
        self.admission = Admission(max_waiting)
        self._inbox: queue.Queue = queue.Queue()  # ("add" | "abort" | "wake", request) from the gRPC side
        self.connector = RemotePrefillConnector(
            pool, whole, engine.config.block_size, self.prefills, self.quarantine, self.admission,
            lambda: self._inbox.put(("wake", None)), self.receiver.lock,
            Backend(kv_transport) if kv_transport else None, prefill_reads_cached_prefix, self.nixl, disagg,
            engine.scheduler.num_prefilling)  # fmt: skip
        engine.connect(self.connector)
        self._active: dict[str, ActiveRequest] = {}
        self._drain_deadline: float | None = None  # set by drain(): no admissions from then on
        self._shutdown_error = (grpc.StatusCode.UNAVAILABLE, f"decode worker {worker_id} is shutting down; retry")
        self.loop = Loop(self._loop_once, "decode-loop")  # the process's main thread runs it (see Loop)

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, role="decode", address=self.address,
                          host_id=self.endpoint.host_id, device=self.endpoint.device, fingerprint=self.fingerprint,
                          block_size=self.engine.config.block_size,
                          transports=",".join(sorted(self.endpoint.transports)), kv_heads=self.kv_heads,
                          **self.load())  # fmt: skip

    def load(self) -> dict[str, int]:
        bm = self.engine.block_manager
        running = sum(r.state in (S.PREFILLING, S.RUNNING) for r in list(self._active.values()))
        return {"free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks, "num_running": running,
                "num_waiting": self.admission.num_waiting}  # fmt: skip

    def drain(self, timeout_s: float) -> None:
        """Stop admitting; the loop stops once the running requests finish or ``timeout_s`` passes."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
            self._inbox.put(("wake", None))  # the loop may be asleep on an empty inbox
            log.info("draining: %d requests active, waiting up to %.0f s", len(self._active), timeout_s)

    def resync(self) -> None:
        """After Redis lost our state (heartbeat thread): publish the leases of the prefills in flight again."""
        for req in list(self.connector.in_flight.values()):
            self.prefills.publish_lease(req, max(0.1, req.lease_deadline - time.monotonic()))

    def stop(self) -> None:
        self.loop.stop()
        self.prefills.close()

    # -- gRPC (event loop) ----------------------------------------------------------------------------

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        span = tracing.start("decode.generate", context.invocation_metadata(), worker=self.worker_id,
                             prompt_tokens=len(request.prompt_token_ids),
                             resumed_tokens=len(request.resumed_output_token_ids))  # fmt: skip
        refusal = None
        try:  # members are checked like anyone: the same rules as the router's (rpc.validation)
            prompt, params, continuation = validate_decode_request(request, self.engine)
        except ValueError as err:
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if self._drain_deadline is not None:
            refusal = self._shutdown_error
        elif refusal is None and not self.admission.enter():
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"decode worker {self.worker_id} has {self.admission.limit} requests waiting for KV blocks "
                       "(its queue limit); retry later or add decode workers")  # fmt: skip
        if refusal is not None:
            span.end(f"{refusal[0].name}: {refusal[1]}")
            await context.abort(*refusal)
        req = ActiveRequest(f"{request.request_id[:64] or 'req'}-{uuid.uuid4().hex[:12]}", request.request_id,
                            prompt, params, asyncio.get_running_loop(), request.preferred_prefill_worker,
                            continuation, request.sampling.priority, span=span)  # fmt: skip
        self._inbox.put(("add", req))
        ended = False
        try:
            while (item := await req.outputs.get()) is not None:
                if isinstance(item, tuple):  # (status code, message)
                    ended = True
                    await context.abort(*item)
                yield item
            ended = True
        finally:
            if not ended:  # the client cancelled or went away
                self._inbox.put(("abort", req))

    def lease_holder(self, request_id: str) -> tuple[list[int], str]:
        """(blocks, prefill worker) of a request whose prefill is in flight; ([], '') otherwise. For PushKV."""
        return self.connector.lease_holder(request_id)

    # -- the loop (main thread) -----------------------------------------------------------------------

    def _loop_once(self) -> None:
        self._drain_inbox()
        self.quarantine.free_ended()
        if self.engine.has_unfinished_requests():
            self._step()
        if self._drain_deadline is not None:
            self._continue_draining()

    def _step(self) -> None:
        try:
            with self.compute:
                outputs = self.engine.step()
        except StepError as err:  # fail the requests of that batch; the rest carry on
            if err.fatal:  # a tensor-parallel rank is lost: no step can run; end as a crash would, so that the
                # supervisor restarts the worker whole and the router moves its streams to another
                log.critical("%s: this worker ends, to be restarted with all its ranks", err)
                logging.shutdown()
                os._exit(70)
            log.error("engine step failed for %d requests: %s", len(err.request_ids), err)
            for rid in err.request_ids:
                if (req := self._active.get(rid)) is not None:
                    self._finish(req, S.FAILED, (grpc.StatusCode.INTERNAL, "decode step failed; see the worker's log"))
            return
        for out in outputs:
            self._guarded(self._emit, self._active.get(out.request_id), out)

    def _guarded(self, fn, req: ActiveRequest | None, *args) -> None:
        """Run one request's piece of the loop; an error fails that request only."""
        if req is None:
            return
        try:
            fn(req, *args)
        except Exception:  # noqa: BLE001 - one request's failure must not end the others
            log.exception("request %s failed in %s", req.request_id, fn.__name__)
            self._finish(req, S.FAILED, (grpc.StatusCode.INTERNAL, "decode worker error; see its log"))

    def _drain_inbox(self) -> None:
        # Sleep on the inbox only while no sequence runs: a finishing prefill call wakes it through the inbox.
        try:
            item = self._inbox.get_nowait() if self.engine.has_running_requests() else self._inbox.get(timeout=0.05)
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "add":
                self._active[req.request_id] = req
                if self._drain_deadline is not None:
                    self._finish(req, S.FAILED, self._shutdown_error)
                else:
                    self._guarded(self._add, req)
            elif kind == "abort" and self._active.get(req.request_id) is req:
                self._finish(req, S.ABORTED)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: ActiveRequest) -> None:
        self.engine.add_request(req.prompt, req.params, req.request_id, continuation=req.continuation, kv_params=req,
                                priority=req.priority)  # fmt: skip

    def _emit(self, req: ActiveRequest, out: RequestOutput) -> None:
        req.emit(req.response(out, self.worker_id))
        if out.finished and req.done:
            self._finish(req, S.FINISHED)

    def _finish(self, req: ActiveRequest, state: RequestState, error: tuple | None = None) -> None:
        """The one way out: the engine lets go of ``req`` (its connector cancels a prefill in flight and frees
        or quarantines the blocks), then its stream ends."""
        if req.state is S.QUEUED and not req.admitted:
            req.admitted = True  # it no longer counts as waiting
            self.admission.leave()
        self.engine.abort(req.request_id)  # no-op once the engine finished it itself
        self._active.pop(req.request_id, None)
        req.end(state, error)

    def _continue_draining(self) -> None:
        for req in [r for r in self._active.values() if r.state is S.QUEUED]:  # never started: retry elsewhere
            self._finish(req, S.FAILED, self._shutdown_error)
        if self._active and time.monotonic() < self._drain_deadline:
            return
        for req in list(self._active.values()):
            self._finish(req, S.FAILED, self._shutdown_error)
        self.loop.stop()
