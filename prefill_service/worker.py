"""A prefill request's life on this worker:

1. ``Prefill`` (a gRPC thread) checks the destination's fingerprint, opens the
   destination pool once per decode worker (``shm``: map its file) and queues
   a job for the batcher, then waits for it.
2. The batcher (``self.loop``: the process's main thread) gathers jobs until
   ``max_batch_tokens`` prompt tokens are waiting or ``max_wait_ms`` has passed
   since the first one, adds them all to its engine with ``max_tokens=1`` and
   steps until each has its first token. Long prompts are chunked by the
   engine's token budget. With ``shm`` every layer stores each new token's K/V
   straight into the destination slots as it is computed; with ``grpc`` the
   finished blocks are read out of our own pool before they are released.
3. Back on the gRPC thread: ``grpc`` streams the bytes to the decode worker's
   ``PushKV`` in checksummed chunks; the answer carries the first token and
   the checksum of the destination blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from engine import LLMEngine, SamplingParams
from rpc.auth import GRPC_OPTIONS
from rpc.convert import sampling_from_proto
from rpc.loop import Loop
from kvstore.kv_cache import KVCache
from kvstore.transfer import (
    checksum,
    checksum_blocks,
    chunked,
    fingerprint,
    open_cuda_ipc_pool,
    open_shared_pool,
    read_blocks,
)
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    destination: pb.KVDestination
    dest_pool: KVCache | None
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # the caller gave up: never start it, or stop it at the next step


@dataclass
class PrefillResult:
    first_token: int
    chunks: list[bytes] | None  # grpc only: our blocks' bytes, as chunked() splits them
    prefill_ms: float


class PrefillWorker(pb_grpc.PrefillServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, max_batch_tokens: int = 4096, max_wait_ms: float = 20.0):
        self.engine = engine
        self.worker_id = worker_id
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000
        runner = engine.runner
        self.fingerprint = fingerprint(engine.model_config.architecture, runner.kv_spec)
        self._pools: dict[str, KVCache] = {}
        self._pools_lock = threading.Lock()
        self._jobs: queue.Queue[PrefillJob] = queue.Queue()
        self._num_running = 0
        self.batch_sizes: list[int] = []  # requests per batch, in order (for tests and stats)
        self.num_cancelled = 0  # jobs dropped because their caller gave up
        self.loop = Loop(self._batch_once, "prefill-batcher")  # the process's main thread runs it (see Loop)

    # -- gRPC -----------------------------------------------------------------------------------------

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        dest = request.destination
        if dest.fingerprint != self.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout fingerprint {dest.fingerprint!r} differs from this prefill worker's {self.fingerprint!r}: "
                "the workers run different models, dtypes or block sizes",
            )
        try:
            params = sampling_from_proto(request.sampling)
            prompt = self.engine.tokenize(list(request.prompt_token_ids))
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if len(dest.block_ids) < self.engine.block_manager.num_blocks_for(len(prompt)):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{len(dest.block_ids)} blocks cannot hold {len(prompt)} tokens"
            )
        pool = None
        if dest.backend == "shm":
            try:
                pool = self._open_pool(dest.shm_path, dest.num_blocks)
            except (OSError, ValueError) as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot map the decode worker's KV pool: {err}")
        elif dest.backend == "cuda_ipc":
            try:
                pool = self._open_ipc_pool(dest.worker_id, dest.cuda_ipc_handle, dest.num_blocks)
            except (RuntimeError, ValueError) as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the decode worker's CUDA pool: {err}")
        elif dest.backend != "grpc":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"transfer backend {dest.backend!r} is not served here")
        job = PrefillJob(request.request_id, prompt, params, dest, pool)
        context.add_callback(lambda: setattr(job, "cancelled", not job.future.done()))
        self._jobs.put(job)
        try:
            remaining = context.time_remaining()  # effectively infinite when the caller set no deadline
            result: PrefillResult = job.future.result(timeout=remaining if remaining < 1e6 else None)
        except TimeoutError:
            job.cancelled = True
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish before the caller's deadline")
        except Exception as err:  # noqa: BLE001 - reported to the caller as the RPC's status
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {err}")
        start = time.perf_counter()
        dst_blocks = list(dest.block_ids)[: self.engine.block_manager.num_blocks_for(len(prompt))]
        if pool is not None:  # shm or cuda_ipc: the bytes are already in the decode worker's pool
            digest = checksum_blocks(pool, dst_blocks)
        else:
            digest = self._push(dest, request.request_id, dst_blocks, result.chunks)
        return pb.PrefillResponse(
            first_token_id=result.first_token,
            checksum=digest,
            num_tokens_written=len(prompt) - request.num_cached_tokens,
            backend=dest.backend,
            prefill_ms=result.prefill_ms,
            transfer_ms=(time.perf_counter() - start) * 1000,
            worker_id=self.worker_id,
        )

    def _open_pool(self, path: str, num_blocks: int) -> KVCache:
        with self._pools_lock:
            if path not in self._pools:
                self._pools[path] = open_shared_pool(self.engine.runner.kv_spec, num_blocks, path)
            return self._pools[path]

    def _open_ipc_pool(self, worker_id: str, handle: bytes, num_blocks: int) -> KVCache:
        key = f"cuda_ipc:{worker_id}:{handle[:64].hex()}"
        with self._pools_lock:
            if key not in self._pools:
                self._pools[key] = open_cuda_ipc_pool(self.engine.runner.kv_spec, num_blocks, handle)
            return self._pools[key]

    def _push(self, dest: pb.KVDestination, request_id: str, dst_blocks: list[int], chunks: list[bytes]) -> str:
        dst_chunks = chunked(dst_blocks)

        def messages():
            for i, data in enumerate(chunks):
                yield pb.KVChunk(
                    request_id=request_id,
                    fingerprint=self.fingerprint,
                    block_ids=dst_chunks[i],
                    data=data,
                    checksum=checksum(data),
                )

        with grpc.insecure_channel(dest.address, options=GRPC_OPTIONS) as channel:
            reply = pb_grpc.KVTransferStub(channel).PushKV(messages(), timeout=30)
        return reply.checksum

    # -- batcher --------------------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        bm = self.engine.block_manager
        return {"free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks,
                "num_running": self._num_running, "num_waiting": self._jobs.qsize()}  # fmt: skip

    def stop(self) -> None:
        self.loop.stop()

    def _collect(self) -> list[PrefillJob]:
        try:
            first = self._jobs.get(timeout=0.1)
        except queue.Empty:
            return []
        batch, tokens = [first], len(first.prompt)
        deadline = first.enqueued + self.max_wait_s
        while tokens < self.max_batch_tokens:
            remaining = deadline - time.perf_counter()
            try:
                job = self._jobs.get(timeout=max(0.0, remaining)) if remaining > 0 else self._jobs.get_nowait()
            except queue.Empty:
                break
            batch.append(job)
            tokens += len(job.prompt)
        return batch

    def _batch_once(self) -> None:
        batch = self._collect()
        if batch:
            self._run(batch)

    def _run(self, batch: list[PrefillJob]) -> None:
        engine = self.engine
        start = time.perf_counter()
        pending: dict[str, PrefillJob] = {}
        self._num_running = len(batch)
        self.batch_sizes.append(len(batch))
        for job in batch:
            if job.cancelled:  # its caller is gone: the destination blocks may already be someone else's
                self.num_cancelled += 1
                continue
            rid = f"prefill-{job.request_id}-{id(job)}"
            params = dataclasses.replace(job.params, max_tokens=1, stop=[], ignore_eos=True)
            try:
                dest = None
                if job.dest_pool is not None:
                    dest = (job.dest_pool.layers, list(job.destination.block_ids))
                engine.add_request(job.prompt, params, rid, kv_destination=dest, hold_blocks=True)
                pending[rid] = job
            except ValueError as err:
                job.future.set_exception(err)
        try:
            while pending:
                for rid in [rid for rid, job in pending.items() if job.cancelled]:
                    self.num_cancelled += 1
                    engine.abort(rid)
                    engine.release(rid)
                    pending.pop(rid)
                for out in engine.step():
                    if not out.finished:
                        continue
                    job = pending.pop(out.request_id, None)
                    if job is None:
                        continue
                    data = None
                    if job.dest_pool is None:
                        table = engine.block_manager.block_table(out.request_id)
                        data = [read_blocks(engine.runner.kv_cache, part) for part in chunked(table)]
                    engine.release(out.request_id)
                    job.future.set_result(PrefillResult(out.token_ids[0], data, (time.perf_counter() - start) * 1e3))
        except Exception as err:  # noqa: BLE001 - fail the whole batch, keep the worker alive
            log.exception("prefill batch failed")
            for rid, job in pending.items():
                engine.abort(rid)
                engine.release(rid)
                job.future.set_exception(err)
        finally:
            self._num_running = 0
