"""A prefill request's life on this worker:

1. ``Prefill`` (a coroutine on the gRPC event loop) checks the request
   (``request.validate_prefill_request``): the destination's fingerprint, its lease
   (signed by the decode worker for this request, this prefill worker and these
   blocks: ``cluster_state.lease``), the prompt and the cached prefix; opens the destination pool
   once per decode worker (``shm``: map its file, only inside this cluster's pool
   directory; closed once that worker is gone: ``destinations``) and queues a
   job for the batcher, then awaits it.
2. The batcher (``self.loop``: the process's main thread) gathers jobs until
   ``max_batch_tokens`` prompt tokens are waiting or ``max_wait_ms`` has passed
   since the first one, adds them all to its engine with ``max_tokens=1`` and
   steps until each has its first token. Long prompts are chunked by the
   engine's token budget. The engine's KV connector (``handoff``) copies each
   step's blocks into the destination pool (``shm``, ``cuda_ipc``) right after
   the step; with ``grpc`` the finished blocks are read out of our own pool
   before they are released. When the lease offers the destination's cached
   prefix blocks (``shm``, ``cuda_ipc``) and names their tokens (the prompt's
   prefix hash), the connector copies them in instead of computing that
   prefix. Reading and writing there stop at the lease's expiry less
   ``lease.WRITE_MARGIN_S``, checked before each step and each layer's copy: a
   job past it fails (DEADLINE_EXCEEDED), its blocks uncached.
3. Back on the event loop: ``grpc`` streams the bytes to the decode worker's
   ``PushKV`` in checksummed chunks; the answer carries the first token and
   the checksum of the destination blocks.
4. Once the batcher will never write into a destination pool for a job again
   (done, dropped or failed), it ends the job's lease in Redis (signed), so
   the decode worker may free blocks it held back after a failed call without
   waiting for the lease to run out. A restarted worker ends the leases its
   dead predecessor left (``Registry.end_leases_of``, at start-up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time

import grpc

from cluster_state import lease
from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo, local_host_id
from engine import LLMEngine
from engine.kv_connector import TRANSFER_EXPIRED
from kvstore.shared_pool import pool_dir
from prefill_service.destinations import Destinations
from prefill_service.handoff import Handoff, HandoffConnector
from prefill_service.jobs import JobQueue, LeaseExpired, PrefillJob, PrefillResult, settle
from prefill_service.request import Refused, validate_prefill_request
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc import metrics, tracing
from rpc.compute_lease import ComputeLease
from rpc.convert import logprobs_to_proto
from rpc.loop import Loop
from security.auth import Security
from security.identity import peer_identity
from transfer.backend import Backend, nixl_installed
from transfer.interface import TransferFailed, UnknownBackend

log = logging.getLogger(__name__)


class PrefillWorker(pb_grpc.PrefillServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, address: str, security: Security,
                 max_batch_tokens: int = 4096, max_wait_ms: float = 20.0,
                 registry: Registry | None = None, compute: ComputeLease | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.compute = compute or ComputeLease(None)  # held around each step (rpc.compute_lease)
        self.worker_id = worker_id
        self.address = address
        self.security = security
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000
        runner = engine.runner
        engine.connect(HandoffConnector(runner.kv_pool, engine.config.block_size))  # every rank's heads move
        self.fingerprint = engine.prefix_salt  # the KV layout, of all heads (the same for every TP size)
        self.kv_heads = runner.kv_heads  # advertised: what each rank holds
        self._nixl = nixl_installed() and not runner.kv_pool.ipc_parts  # (NIXL registers our pool's parts)
        self.destinations = Destinations(runner.kv_pool.spec, self.fingerprint, worker_id, security, registry,
                                         runner.device)  # fmt: skip
        self._jobs = JobQueue()
        self._num_running = 0
        self.batch_sizes: list[int] = []  # requests per batch, in order (for tests and stats)
        self.num_cancelled = 0  # jobs dropped because their caller gave up
        self.num_expired = 0  # jobs failed because their lease ran out before they were done
        self._drain_deadline: float | None = None
        self.loop = Loop(self._batch_once, "prefill-batcher")  # the process's main thread runs it (see Loop)
        self.loop.add_hook(self.destinations.close_gone_pools)
        self.nonces = lease.NonceBook()  # the leases we accepted: each is accepted once

    # -- gRPC (event loop) ----------------------------------------------------------------------------

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        dest = request.destination
        span = tracing.start("prefill.request", context.invocation_metadata(), worker=self.worker_id,
                             prompt_tokens=len(request.prompt_token_ids), backend=dest.backend,
                             destination=dest.worker_id, held_tokens=request.num_cached_tokens)  # fmt: skip
        with span:
            return await self._prefill(request, context, span)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext,
                       span: tracing.Span) -> pb.PrefillResponse:  # fmt: skip
        dest = request.destination
        try:
            if self._drain_deadline is not None:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.worker_id} is shutting down")
            checked = validate_prefill_request(request, self.engine, self.fingerprint, lambda: lease.request_refusal(
                self.security, request, peer_identity(context), self.worker_id, pool_dir(), self.nonces))  # fmt: skip
            transport = self._open(dest)
        except Refused as refusal:
            await context.abort(refusal.code, refusal.message)
        job = PrefillJob(request.request_id, checked.prompt, checked.params, dest, transport, checked.num_cached_tokens,
                         lease.write_deadline(dest), priority=request.sampling.priority)  # fmt: skip
        self._jobs.put_job(job)
        try:
            result: PrefillResult = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:  # the caller gave up (cancelled, deadline): never write for it again
            job.cancelled = True
            raise
        except LeaseExpired as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        except Exception as err:  # noqa: BLE001 - reported to the caller as the RPC's status
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {err}")
        start, written = time.perf_counter(), list(dest.block_ids)[: checked.num_blocks]
        span.record("prefill.queue", job.enqueued, result.started)
        prefilled = start - result.take_ms / 1e3
        span.record("prefill.compute", result.started, prefilled, steps=result.num_steps,
                    cached_tokens=result.num_cached_tokens, tier_loaded_tokens=result.num_tier_tokens)  # fmt: skip
        try:
            digest = await transport.finish(request.request_id, written, result.taken)
        except TransferFailed as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pushing the KV to decode worker {dest.worker_id} "
                                f"failed: {err}")  # fmt: skip
        span.record("prefill.handoff", prefilled, time.perf_counter(), backend=dest.backend, blocks=len(written),
                    bytes=len(written) * self.engine.runner.kv_pool.spec.bytes_per_block())  # fmt: skip
        return pb.PrefillResponse(
            first_token_logprob=logprobs_to_proto([result.first_logprob])[0] if result.first_logprob else None,
            prompt_logprobs=logprobs_to_proto(result.prompt_logprobs or ()),
            first_token_id=result.first_token,
            num_cached_tokens=result.num_cached_tokens,
            checksum=digest,
            num_tokens_written=len(checked.prompt) - checked.num_cached_tokens,
            backend=dest.backend,
            prefill_ms=result.prefill_ms,
            transfer_ms=result.take_ms + (time.perf_counter() - start) * 1000,
            worker_id=self.worker_id,
        )

    def _open(self, dest: pb.KVDestination):  # noqa: ANN202 - a KVTransport
        """The destination pool's transport, or ``Refused``."""
        try:
            return self.destinations.open(dest)
        except UnknownBackend as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        except (OSError, RuntimeError, ValueError) as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"cannot open the decode worker's KV pool: {err}") from None

    # -- batcher --------------------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        bm = self.engine.block_manager
        return {"free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks,
                "num_running": self._num_running, "num_waiting": self._jobs.qsize()}  # fmt: skip

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, role="prefill", address=self.address, host_id=local_host_id(),
                          device=str(self.engine.runner.device), fingerprint=self.fingerprint,
                          block_size=self.engine.config.block_size, transports=Backend.NIXL if self._nixl else "",
                          kv_heads=self.kv_heads, **self.load())  # fmt: skip

    def drain(self, timeout_s: float) -> None:
        """Refuse new prefills; the batcher stops once the queued ones are done or ``timeout_s`` passes."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s

    def stop(self) -> None:
        self.loop.stop()
        self.destinations.close()

    def _collect(self) -> list[PrefillJob]:
        try:
            first = self._jobs.get_job(timeout=0.1)
        except queue.Empty:
            return []
        batch, tokens = [first], len(first.prompt)
        deadline = first.enqueued + self.max_wait_s
        while tokens < self.max_batch_tokens:
            remaining = deadline - time.perf_counter()
            try:
                job = self._jobs.get_job(timeout=max(0.0, remaining))
            except queue.Empty:
                break
            batch.append(job)
            tokens += len(job.prompt)
        return batch

    def _batch_once(self) -> None:
        batch = self._collect()
        if not batch:
            if self._drain_deadline is not None and (self._jobs.empty() or time.monotonic() > self._drain_deadline):
                self.loop.stop()
            return
        try:
            self._run(batch)
        except Exception as err:  # noqa: BLE001 - fail this batch's callers, keep the worker serving
            log.exception("prefill batch of %d failed", len(batch))
            for job in batch:
                settle(job, error=err)
                self._end_writes(job, "failed")
        finally:
            self._num_running = 0

    def _run(self, batch: list[PrefillJob]) -> None:
        """Prefill ``batch`` together. Every job's future is settled, and its blocks released, on every path."""
        engine, bs = self.engine, self.engine.config.block_size
        start = time.perf_counter()
        pending: dict[str, PrefillJob] = {}
        self._num_running = len(batch)
        self.batch_sizes.append(len(batch))
        metrics.PREFILL_BATCH.observe(len(batch))
        for job in batch:
            rid = f"prefill-{job.request_id}-{id(job)}"
            if job.cancelled or job.expired:  # the destination blocks may already be someone else's
                self._stop(rid, job)
                continue
            # one token, drawn as the decode worker would (min_tokens keeps it from being an end token there too)
            params = dataclasses.replace(job.params, max_tokens=1, min_tokens=min(job.params.min_tokens, 1), stop=[],
                                         n=1)  # fmt: skip
            # The table from position 0: its first ``skip`` blocks hold what the destination has and are never
            # written; we read them when the lease offers them, else a leased block stands in as a placeholder.
            # Without a pool to write (``grpc``) the hand-off only keeps our blocks for the transport to read.
            pool, skip = job.transport.pool, job.dest_cached_tokens // bs
            cached = list(job.destination.cached_block_ids)
            leased = list(job.destination.block_ids)
            try:
                handoff = Handoff(pool, (cached or leased[:1] * skip) + leased, bs,
                                  job.dest_cached_tokens, bool(cached and pool), job.write_until)  # fmt: skip
                engine.add_request(job.prompt, params, rid, kv_params=handoff, priority=job.priority)
                pending[rid] = job
            except Exception as err:  # noqa: BLE001 - this job only
                settle(job, error=err)
                self._end_writes(job, "failed")
        num_steps = 0
        try:
            while pending:
                for rid in [rid for rid, job in pending.items() if job.cancelled or job.expired]:
                    self._stop(rid, pending.pop(rid))
                num_steps += 1
                with self.compute:
                    outputs = engine.step()
                for out in outputs:
                    job = pending.pop(out.request_id, None) if out.finished else None
                    if job is None:
                        continue
                    if out.finish_reason == TRANSFER_EXPIRED:  # the connector stopped reading and writing there
                        self._stop(out.request_id, job)
                        continue
                    table = engine.block_manager.block_table(out.request_id)[job.dest_cached_tokens // bs :]
                    leased = list(job.destination.block_ids)[: len(table)]  # before our blocks are released:
                    prefilled = time.perf_counter()
                    taken = job.transport.take(engine.runner.kv_pool, table, job.request_id, leased, job.write_until)
                    took = time.perf_counter()
                    engine.release(out.request_id)
                    self._end_writes(job, "success")
                    metrics.count_prefill_tokens(len(job.prompt), out.num_cached_tokens, out.num_external_tokens)
                    settle(job, PrefillResult(out.token_ids[0], taken, (prefilled - start) * 1e3,
                                              out.num_cached_tokens, (took - prefilled) * 1e3,
                                              out.logprobs[0] if out.logprobs else None,
                                              out.prompt_logprobs[1:] if out.prompt_logprobs else None,
                                              start, num_steps, out.num_external_tokens))  # fmt: skip
        finally:
            for rid, job in pending.items():
                self._drop(rid)
                self._end_writes(job, "failed")

    def _count_cancelled(self) -> None:
        self.num_cancelled += 1
        metrics.REQUESTS.labels("prefill", "aborted").inc()

    def _stop(self, rid: str, job: PrefillJob) -> None:
        """End a job its caller gave up on, or whose lease ran out (the caller hears DEADLINE_EXCEEDED)."""
        if job.cancelled:
            self._count_cancelled()
        else:
            self.num_expired += 1
            settle(job, error=LeaseExpired(f"the lease for {job.request_id!r} ran out before its prompt was done "
                                           "(it was neither read nor written from then on)"))  # fmt: skip
        self._drop(rid)
        self._end_writes(job, "failed")

    def _end_writes(self, job: PrefillJob, state: str) -> None:
        """Once, when no write of ours into ``job``'s destination pool can come any more: end its lease."""
        if job.transport.backend.writes_in_place and not job.writes_ended:
            job.writes_ended = True
            self.destinations.end_lease(job.request_id, state)

    def _drop(self, rid: str) -> None:
        self.engine.abort(rid)
        self.engine.release(rid)
