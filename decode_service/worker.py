"""A request's life on the decode worker (decode allocates first, prefill pushes); states in ``request.py``:

1. ``Generate`` (a coroutine on the gRPC event loop) validates the request (a continuation of a stream
   another worker began included) and queues it (QUEUED); past ``max_waiting`` queued: RESOURCE_EXHAUSTED,
   while draining: UNAVAILABLE (the router retries elsewhere).
2. The engine loop (``self.loop``: the process's main thread, the engine's only user) takes queued requests
   in order while the pool has blocks for them, reserves them (RESERVED) and calls a prefill worker's
   ``Prefill`` with the block ids under a signed lease (PREFILLING); with no prefill worker it prefills
   locally (RUNNING).
3. The prefill worker writes the KV into those blocks (``shm``: in place; ``grpc``: ``KVReceiver.PushKV``)
   and answers with the first token and a checksum, which we verify against our blocks (RUNNING). A failed
   prefill is retried on another prefill worker, then locally; blocks its writer may still touch are
   quarantined until it ends the lease, or the lease's expiry plus a grace (``prefill_client.Quarantine``).
4. Every step's tokens go to the request's stream. Every exit (FINISHED, ABORTED by a gone client, FAILED)
   goes through ``_finish``, which frees the blocks, the lease and the stream; a loop error fails only the
   requests it concerns. SIGTERM drains: no admissions, queued requests handed back (UNAVAILABLE), running
   ones finish within the drain timeout, and what still runs then ends with UNAVAILABLE, which the router
   turns into a continuation on another decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
import uuid
from collections import deque

import grpc

from decode_service.kv_receiver import KVReceiver
from decode_service.prefill_client import PrefillClient, Quarantine
from decode_service.request import ActiveRequest, Admission, RequestState, validate_decode_request
from engine import LLMEngine, RequestOutput
from engine.outputs import StepError
from kvstore.registry import Registry
from kvstore.transfer import choose_backend, export_cuda_ipc, fingerprint
from kvstore.workers import WorkerInfo, local_host_id
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.auth import Security
from rpc.loop import AsyncioThread, Loop

log = logging.getLogger(__name__)
S = RequestState


class DecodeWorker(pb_grpc.DecodeServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, address: str, aio: AsyncioThread, security: Security,
                 registry: Registry | None = None, shm_path: str = "", max_waiting: int = 64,
                 prefill_timeout_s: float = 30.0, prefill_ms_per_token: float = 20.0,
                 force_backend: str | None = None, prefill_reads_cached_prefix: bool = True) -> None:  # fmt: skip
        self.engine, self.worker_id, self.address, self.security = engine, worker_id, address, security
        self.shm_path, self.force_backend = shm_path, force_backend
        self.prefill_reads_cached_prefix = prefill_reads_cached_prefix  # see _submit_prefill
        self.host_id = local_host_id()
        self.cuda_ipc_handle = export_cuda_ipc(engine.runner.kv_cache) if engine.runner.device.type == "cuda" else b""
        self.fingerprint = fingerprint(engine.model_config.architecture, engine.runner.kv_spec)
        self.prefills = PrefillClient(aio, security, worker_id, self.fingerprint, registry, prefill_timeout_s,
                                      prefill_ms_per_token)  # fmt: skip
        self.receiver = KVReceiver(engine.runner.kv_cache, self.fingerprint, self.lease_holder)
        self._inbox: queue.Queue = queue.Queue()  # ("add" | "abort" | "wake", request) from the gRPC side
        self._queued: deque[ActiveRequest] = deque()
        self._active: dict[str, ActiveRequest] = {}
        self.quarantine = Quarantine(engine.block_manager, self.prefills)
        self.admission = Admission(max_waiting)
        self._drain_deadline: float | None = None  # set by drain(): no admissions from then on
        self._shutdown_error = (grpc.StatusCode.UNAVAILABLE, f"decode worker {worker_id} is shutting down; retry")
        self.loop = Loop(self._loop_once, "decode-loop")  # the process's main thread runs it (see Loop)

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, role="decode", address=self.address, host_id=self.host_id,
                          device=str(self.engine.runner.device), fingerprint=self.fingerprint,
                          block_size=self.engine.config.block_size, **self.load())  # fmt: skip

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
        for req in [r for r in list(self._active.values()) if r.state is S.PREFILLING]:
            self.prefills.publish_lease(req, max(0.1, req.lease_deadline - time.monotonic()))

    def stop(self) -> None:
        self.loop.stop()
        self.prefills.close()

    # -- gRPC (event loop) ----------------------------------------------------------------------------

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        if self._drain_deadline is not None:
            await context.abort(*self._shutdown_error)
        try:  # members are checked like anyone: the same rules as the router's (rpc.validation)
            prompt, params, continuation = validate_decode_request(request, self.engine)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not self.admission.enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker {self.worker_id} has {self.admission.limit} requests waiting for KV "
                                "blocks (its queue limit); retry later or add decode workers")  # fmt: skip
        req = ActiveRequest(f"{request.request_id[:64] or 'req'}-{uuid.uuid4().hex[:12]}", request.request_id,
                            prompt, params, asyncio.get_running_loop(), request.preferred_prefill_worker,
                            continuation)  # fmt: skip
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
        req = self._active.get(request_id)
        live = req is not None and req.state is S.PREFILLING and req.prefill_worker
        return (req.leased, req.prefill_worker) if live else ([], "")

    # -- the loop (main thread) -----------------------------------------------------------------------

    def _loop_once(self) -> None:
        self._drain_inbox()
        self._start_prefills()
        self._collect_prefills()
        self.quarantine.free_ended()
        if self.engine.has_unfinished_requests():
            self._step()
        if self._drain_deadline is not None:
            self._continue_draining()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as err:  # fail the requests of that batch; the rest carry on
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
        # Sleep on the inbox only while the engine is idle: a finishing prefill call wakes it through the inbox.
        try:
            item = self._inbox.get_nowait() if self.engine.has_unfinished_requests() else self._inbox.get(timeout=0.05)
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "add":
                self._active[req.request_id] = req
                self._queued.append(req)
                if self._drain_deadline is not None:
                    self._finish(req, S.FAILED, self._shutdown_error)
            elif kind == "abort" and self._active.get(req.request_id) is req:
                req.cancelled = True
                if req.state is not S.PREFILLING:  # an in-flight prefill is ended when its call returns
                    self._finish(req, S.ABORTED)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _start_prefills(self) -> None:
        while self._queued:
            req = self._queued[0]
            reserved = self.engine.reserve(req.request_id, req.tokens)  # our cached prefix, then new blocks
            if reserved is None and self.engine.has_unfinished_requests():
                return  # wait for running sequences to finish and free blocks
            self._queued.popleft()
            self.admission.leave()
            if reserved is None:  # idle and still no room: let the engine's own scheduler admit it in chunks
                self._guarded(self._start_local, req)
                continue
            req.block_ids, req.num_cached_tokens = reserved
            req.move(S.RESERVED)
            self._guarded(self._submit_prefill, req)

    def _submit_prefill(self, req: ActiveRequest) -> None:
        target = self.prefills.pick(req.tried, req.preferred_prefill)
        if target is None:
            self.engine.release(req.request_id)
            self._start_local(req)
            return
        device = str(self.engine.runner.device)
        backend = self.force_backend or choose_backend(target.host_id, self.host_id, device, bool(self.shm_path))
        timeout = self.prefills.timeout_for(len(req.tokens))
        req.move(S.PREFILLING)
        req.backend, req.lease_deadline = backend, time.monotonic() + timeout
        held = req.block_ids[: req.num_cached_tokens // self.engine.config.block_size]  # our cached prefix
        req.leased = req.block_ids[len(held) :]  # what P writes
        # P maps our pool: it may read ``held`` in place instead of computing it (our reservation keeps it)
        offered = held if self.prefill_reads_cached_prefix and backend in ("shm", "cuda_ipc") else []
        dest = pb.KVDestination(worker_id=self.worker_id, backend=backend, address=self.address,
                                fingerprint=self.fingerprint, block_ids=req.leased, shm_path=self.shm_path,
                                num_blocks=self.engine.runner.num_blocks, cuda_ipc_handle=self.cuda_ipc_handle,
                                cached_block_ids=offered)  # fmt: skip
        self.prefills.start(req, target, dest, timeout)
        req.future.add_done_callback(lambda _: self._inbox.put(("wake", req)))

    def _start_local(self, req: ActiveRequest) -> None:
        req.move(S.RUNNING)
        req.backend, req.prefill_worker = "local", ""
        self.engine.add_request(req.prompt, req.params, req.request_id, continuation=req.continuation)

    def _collect_prefills(self) -> None:
        for req in [r for r in self._active.values() if r.state is S.PREFILLING]:
            if req.future.done() or time.monotonic() >= req.lease_deadline or req.cancelled:
                self._guarded(self._collect_prefill, req)

    def _collect_prefill(self, req: ActiveRequest) -> None:
        num_written = self.engine.block_manager.num_blocks_for(len(req.tokens)) - len(req.block_ids) + len(req.leased)
        reply, error, writer_done = self.prefills.outcome(req, self.engine.runner.kv_cache, num_written)
        if req.cancelled:
            self._finish(req, S.ABORTED, writer_done=writer_done)
        elif error is None:
            self.prefills.end_lease(req.request_id, req.prefill_worker)
            req.prefill_ms, req.transfer_ms = reply.prefill_ms, reply.transfer_ms
            req.move(S.RUNNING)
            self._emit(req, self.engine.add_prefilled(req.request_id, req.prompt, req.params, reply.first_token_id,
                                                      req.continuation))  # fmt: skip
        else:
            log.warning("prefill of %s on %s failed (%s); retrying", req.request_id, req.prefill_worker, error)
            self._release_blocks(req, writer_done)
            req.move(S.RESERVED)
            req.block_ids, req.num_cached_tokens = self.engine.reserve(req.request_id, req.tokens) or ([], 0)
            if req.block_ids:
                self._submit_prefill(req)
            else:
                self._start_local(req)

    def _release_blocks(self, req: ActiveRequest, writer_done: bool) -> None:
        """Free a request's reserved blocks, or quarantine them while a prefill worker may still write. A
        ``grpc`` writer can write only through PushKV, which a revoked lease stops at once."""
        writer = req.prefill_worker
        with self.receiver.lock:
            req.prefill_worker = ""  # revoke: lease_holder() names no one
        if writer_done or req.backend == "grpc":
            self.engine.release(req.request_id)
            self.prefills.end_lease(req.request_id, writer)
        elif self.engine.block_manager.has(req.request_id):
            self.quarantine.hold(req.request_id, writer, req.prefill_address, req.lease_deadline)

    def _emit(self, req: ActiveRequest, out: RequestOutput) -> None:
        req.emit(req.response(out, self.worker_id))
        if out.finished:
            self._finish(req, S.FINISHED)

    def _finish(self, req: ActiveRequest, state: RequestState, error: tuple | None = None,
                writer_done: bool = False) -> None:  # fmt: skip
        """The one way out: free what ``req`` holds in its current state, then end its stream."""
        if req.state is S.QUEUED and req in self._queued:
            self._queued.remove(req)
            self.admission.leave()
        elif req.state is S.RUNNING:
            self.engine.abort(req.request_id)  # no-op once the engine finished it itself
        elif req.state in (S.RESERVED, S.PREFILLING):
            if req.state is S.PREFILLING:
                req.future.cancel()
            self._release_blocks(req, writer_done or req.state is S.RESERVED)
        self._active.pop(req.request_id, None)
        req.end(state, error)

    def _continue_draining(self) -> None:
        for req in list(self._queued):  # never started: the router can retry them elsewhere
            self._finish(req, S.FAILED, self._shutdown_error)
        if self._active and time.monotonic() < self._drain_deadline:
            return
        for req in list(self._active.values()):
            self._finish(req, S.FAILED, self._shutdown_error)
        self.loop.stop()

