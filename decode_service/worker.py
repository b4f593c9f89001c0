"""A request's life on the decode worker (decode allocates first, prefill pushes):

1. ``Generate`` (a gRPC thread) validates the request and queues it; when
   ``max_waiting`` requests are already queued it answers RESOURCE_EXHAUSTED.
2. The loop (``self.loop``: the process's main thread), the engine's only user,
   takes queued requests in order while the pool has blocks for their prompts:
   it reserves the blocks, writes a lease and calls a prefill worker's
   ``Prefill`` (in a thread pool) with the block ids. With no prefill worker
   registered it prefills locally.
3. The prefill worker writes the prompt's KV into those blocks (``shm``: in
   place; ``grpc``: through ``KVReceiver.PushKV``) and answers with the first token
   and a checksum, which we verify against our own blocks. The sequence then
   joins the running batch. A failed prefill is retried on another prefill
   worker, then locally; one that outlives its lease has its blocks
   quarantined (it may still write to them) and is retried in fresh blocks.
4. Every step's tokens go to the request's queue, from which ``Generate``
   streams them. A cancelled or disconnected client aborts the request and
   its blocks are freed at once (after its prefill returns, if one is in
   flight).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from decode_service.kv_receiver import KVReceiver
from engine import LLMEngine, RequestOutput, SamplingParams
from rpc.auth import GRPC_OPTIONS
from rpc.convert import sampling_from_proto, sampling_to_proto
from rpc.loop import Loop
from kvstore.registry import Registry
from kvstore.transfer import checksum_blocks, choose_backend, export_cuda_ipc, fingerprint
from kvstore.workers import WorkerInfo, local_host_id
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ActiveRequest:
    request_id: str  # unique inside this worker; the client's id travels in ``public_id``
    public_id: str
    prompt: list[int]
    params: SamplingParams
    preferred_prefill: str = ""
    outputs: queue.Queue = field(default_factory=queue.Queue)  # GenerateResponse, then None (or a grpc error)
    received: float = field(default_factory=time.perf_counter)
    state: str = "queued"  # queued -> prefilling -> running -> done
    cancelled: bool = False
    future: Future | None = None
    prefill_worker: str = ""
    backend: str = "local"
    lease_deadline: float = 0.0
    tried: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0


class DecodeWorker(pb_grpc.DecodeServicer):
    def __init__(
        self,
        engine: LLMEngine,
        worker_id: str,
        address: str,
        registry: Registry | None = None,
        shm_path: str = "",
        max_waiting: int = 64,
        prefill_timeout_s: float = 30.0,
        force_backend: str | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.address = address
        self.registry = registry
        self.shm_path = shm_path
        self.max_waiting = max_waiting
        self.prefill_timeout_s = prefill_timeout_s
        self.force_backend = force_backend
        self.host_id = local_host_id()
        self.cuda_ipc_handle = b""
        if engine.runner.device.type == "cuda":
            self.cuda_ipc_handle = export_cuda_ipc(engine.runner.kv_cache)
        self.fingerprint = fingerprint(engine.model_config.architecture, engine.runner.kv_spec)
        self.receiver = KVReceiver(engine.runner.kv_cache, self.fingerprint, self._reserved_blocks)
        self._inbox: queue.Queue = queue.Queue()
        self._queued: deque[ActiveRequest] = deque()
        self._active: dict[str, ActiveRequest] = {}
        self._quarantine: list[tuple[float, str]] = []
        self.num_quarantined = 0  # reservations held back from a prefill that may still write
        self._prefill_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="prefill-call")
        self._num_waiting = 0
        self._waiting_lock = threading.Lock()
        self.loop = Loop(self._loop_once, "decode-loop")  # the process's main thread runs it (see Loop)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role="decode", address=self.address, host_id=self.host_id,
            device=str(self.engine.runner.device), fingerprint=self.fingerprint,
            transfer={"shm_path": self.shm_path, "num_blocks": self.engine.runner.num_blocks}, **self.load(),
        )  # fmt: skip

    def load(self) -> dict[str, int]:
        bm = self.engine.block_manager
        return {"free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks,
                "num_running": sum(r.state in ("prefilling", "running") for r in list(self._active.values())),
                "num_waiting": max(0, self._num_waiting)}  # fmt: skip

    def stop(self) -> None:
        self.loop.stop()
        self._prefill_pool.shutdown(wait=False, cancel_futures=True)

    # -- gRPC -----------------------------------------------------------------------------------------

    def Generate(self, request: pb.DecodeRequest, context: grpc.ServicerContext):
        try:
            params = sampling_from_proto(request.sampling)
            prompt = self.engine.tokenize(list(request.prompt_token_ids))
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        with self._waiting_lock:
            full = self._num_waiting >= self.max_waiting
            if not full:
                self._num_waiting += 1
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode worker {self.worker_id} has {self.max_waiting} requests waiting for KV blocks "
                "(its queue limit); retry later or add decode workers",
            )
        internal_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        req = ActiveRequest(internal_id, request.request_id, prompt, params, request.preferred_prefill_worker)
        self._inbox.put(("add", req))
        context.add_callback(lambda: self._inbox.put(("abort", req)))
        while True:
            item = req.outputs.get()
            if item is None:
                return
            if isinstance(item, tuple):  # (status code, message)
                context.abort(*item)
            yield item

    def _reserved_blocks(self, request_id: str) -> list[int]:
        req = self._active.get(request_id)
        return req.block_ids if req is not None and req.state == "prefilling" else []

    # -- the loop -------------------------------------------------------------------------------------

    def _loop_once(self) -> None:
        try:
            self._drain_inbox()
            self._start_prefills()
            self._collect_prefills()
            self._free_quarantine()
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    self._emit(out)
        except Exception:  # noqa: BLE001 - the loop must survive; the failing requests are told
            log.exception("decode loop iteration failed")
            for req in list(self._active.values()):
                self._fail(req, grpc.StatusCode.INTERNAL, "decode worker error; see its log")

    def _dequeued(self) -> None:
        with self._waiting_lock:
            self._num_waiting -= 1

    def _idle_wait_s(self) -> float:
        """How long the loop may sleep on its inbox: not at all while the engine has work. A finishing
        prefill call wakes it through the inbox, so in-flight prefills need no polling."""
        return 0.0 if self.engine.has_unfinished_requests() else 0.05

    def _drain_inbox(self) -> None:
        wait = self._idle_wait_s()
        try:
            item = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "wake":
                pass
            elif kind == "add":
                self._active[req.request_id] = req
                self._queued.append(req)
            else:
                self._abort(req)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, req: ActiveRequest) -> None:
        if req.state == "done" or self._active.get(req.request_id) is not req:
            return
        req.cancelled = True
        if req.state == "queued":
            self._queued.remove(req)
            self._dequeued()
        elif req.state == "running":
            self.engine.abort(req.request_id)
        if req.state != "prefilling":  # an in-flight prefill frees its blocks when it returns
            self._done(req)

    def _start_prefills(self) -> None:
        while self._queued:
            req = self._queued[0]
            blocks = self.engine.reserve(req.request_id, len(req.prompt))
            if blocks is None and self.engine.has_unfinished_requests():
                return  # wait for running sequences to finish and free blocks
            self._queued.popleft()
            self._dequeued()
            if blocks is None:  # idle and still no room: let the engine's own scheduler admit it in chunks
                self._start_local(req)
                continue
            req.block_ids = blocks
            self._submit_prefill(req)

    def _submit_prefill(self, req: ActiveRequest) -> None:
        target = self._pick_prefill_worker(req)
        if target is None:
            self.engine.release(req.request_id)
            self._start_local(req)
            return
        backend = self.force_backend or choose_backend(target.host_id, self.host_id, str(self.engine.runner.device),
                                                       bool(self.shm_path))  # fmt: skip
        req.state, req.prefill_worker, req.backend = "prefilling", target.worker_id, backend
        req.tried.append(target.worker_id)
        req.lease_deadline = time.monotonic() + self.prefill_timeout_s
        if self.registry is not None:
            self.registry.put_lease(req.request_id, self.worker_id, target.worker_id, req.block_ids,
                                    ttl_s=self.prefill_timeout_s)  # fmt: skip
        dest = pb.KVDestination(
            worker_id=self.worker_id, backend=backend, address=self.address, fingerprint=self.fingerprint,
            block_ids=req.block_ids, shm_path=self.shm_path, num_blocks=self.engine.runner.num_blocks,
            host_id=self.host_id, cuda_ipc_handle=self.cuda_ipc_handle,
        )  # fmt: skip
        call = pb.PrefillRequest(request_id=req.request_id, prompt_token_ids=req.prompt,
                                 sampling=sampling_to_proto(req.params), destination=dest)  # fmt: skip
        req.future = self._prefill_pool.submit(_call_prefill, target.address, call, self.prefill_timeout_s)
        req.future.add_done_callback(lambda _: self._inbox.put(("wake", req)))

    def _pick_prefill_worker(self, req: ActiveRequest) -> WorkerInfo | None:
        if self.registry is None:
            return None
        candidates = [w for w in self.registry.workers("prefill")
                      if w.fingerprint == self.fingerprint and w.worker_id not in req.tried]  # fmt: skip
        if not candidates:
            return None
        preferred = [w for w in candidates if w.worker_id == req.preferred_prefill]
        return (preferred or sorted(candidates, key=lambda w: (w.num_running + w.num_waiting, w.worker_id)))[0]

    def _start_local(self, req: ActiveRequest) -> None:
        req.state, req.backend, req.prefill_worker = "running", "local", ""
        self.engine.add_request(req.prompt, req.params, req.request_id)

    def _collect_prefills(self) -> None:
        for req in [r for r in self._active.values() if r.state == "prefilling"]:
            done = req.future.done()
            if not done and time.monotonic() < req.lease_deadline:
                continue
            if self.registry is not None:
                self.registry.delete_lease(req.request_id)
            if req.cancelled:
                self._release_after(req, done and not req.future.exception())
                self._done(req)
                continue
            error, writer_done = None, False
            if done:
                try:
                    reply: pb.PrefillResponse = req.future.result()
                    if reply.checksum != checksum_blocks(self.engine.runner.kv_cache, self._written_blocks(req)):
                        error = "checksum of the written KV does not match"
                except grpc.RpcError as err:
                    error = f"{err.code().name}: {err.details()}"
                    # refused up front: the prefill worker never queued it, so it will never write
                    writer_done = err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
                except Exception as err:  # noqa: BLE001 - any failure of the call means: retry elsewhere
                    error = f"{type(err).__name__}: {err}"
            else:
                error = "lease expired"
            if error is None:
                req.prefill_ms, req.transfer_ms = reply.prefill_ms, reply.transfer_ms
                req.state = "running"
                self._emit(self.engine.add_prefilled(req.request_id, req.prompt, req.params, reply.first_token_id))
                continue
            log.warning("prefill of %s on %s failed (%s); retrying", req.request_id, req.prefill_worker, error)
            self._release_after(req, writer_done)
            req.block_ids = self.engine.reserve(req.request_id, len(req.prompt)) or []
            if req.block_ids:
                self._submit_prefill(req)
            else:
                self._start_local(req)

    def _written_blocks(self, req: ActiveRequest) -> list[int]:
        return req.block_ids[: self.engine.block_manager.num_blocks_for(len(req.prompt))]

    def _release_after(self, req: ActiveRequest, writer_done: bool) -> None:
        """Free a request's reserved blocks, or quarantine them while a prefill worker may still write."""
        if writer_done:
            self.engine.release(req.request_id)
        else:
            stale = f"{req.request_id}#stale-{time.monotonic_ns()}"
            self.engine.block_manager.rename(req.request_id, stale)
            self._quarantine.append((time.monotonic() + self.prefill_timeout_s, stale))
            self.num_quarantined += 1

    def _free_quarantine(self) -> None:
        now = time.monotonic()
        keep = []
        for until, stale in self._quarantine:
            if until <= now:
                self.engine.block_manager.free(stale)
            else:
                keep.append((until, stale))
        self._quarantine = keep

    def _emit(self, out: RequestOutput) -> None:
        req = self._active.get(out.request_id)
        if req is None:
            return
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        msg = pb.GenerateResponse(request_id=req.public_id, token_ids=out.new_token_ids, text=out.new_text)
        if out.finished:
            msg.finish_reason = out.finish_reason or ""
            msg.usage.prompt_tokens = len(req.prompt)
            msg.usage.completion_tokens = len(out.token_ids)
            msg.timings.ttft_ms = (req.first_token_at - req.received) * 1000
            msg.timings.total_ms = (now - req.received) * 1000
            msg.timings.prefill_ms = req.prefill_ms
            msg.timings.transfer_ms = req.transfer_ms
            msg.transfer_backend = req.backend
            msg.decode_worker = self.worker_id
            msg.prefill_worker = req.prefill_worker
        req.outputs.put(msg)
        if out.finished:
            self._done(req)

    def _fail(self, req: ActiveRequest, code: grpc.StatusCode, message: str) -> None:
        if req.state == "running":
            self.engine.abort(req.request_id)
        req.outputs.put((code, message))
        self._done(req)

    def _done(self, req: ActiveRequest) -> None:
        req.state = "done"
        req.outputs.put(None)
        self._active.pop(req.request_id, None)


def _call_prefill(address: str, request: pb.PrefillRequest, timeout_s: float) -> pb.PrefillResponse:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        return pb_grpc.PrefillStub(channel).Prefill(request, timeout=timeout_s)
