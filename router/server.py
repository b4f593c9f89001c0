"""A request's life in the router (``grpc.aio``: one coroutine per stream, never a thread):

``Router.generate`` is the whole life as an async generator over a ``pb.GenerateRequest``; the gRPC
``Generate`` and the OpenAI-compatible HTTP API (``router.openai_api``) both consume it, with no second hop.

1. ``generate`` validates the request with ``rpc.validation`` on the router's one validation thread (it
   tokenizes, rendering chat messages with the model's chat template), smallest request first and with a
   bounded backlog (``router.validation_queue``); anything wrong ends the call with INVALID_ARGUMENT (HTTP
   400) and a message saying what to change, a full backlog with RESOURCE_EXHAUSTED (HTTP 429).
2. It reads the live workers from the registry (off the event loop: a Redis outage must not stall the
   streams) or, without one, takes the static decode addresses; a worker is used only once a direct gRPC
   health check answered SERVING (``WorkerHealth``). It ranks the decode workers by load and names the
   least-loaded prefill worker for the decode worker to use, counting both choices as in flight in the same
   step, so that a burst between two heartbeats spreads.
3. It calls the first decode worker with the cluster token and relays its stream; the decode worker's
   text deltas come from an incremental detokenizer and never end inside a multi-byte character. A worker
   that fails before its first token is replaced by the next one (and, when it was UNAVAILABLE, skipped by
   later requests until a health check says it serves again). One that fails after it (it died, or drained
   at SIGTERM) is replaced too: the next worker gets the prompt plus the tokens already relayed and the
   number of characters sent (``DecodeRequest.resumed_output_token_ids``), computes their KV and goes on as
   the first would have (greedy and seeded requests give the same tokens), so the client sees one
   uninterrupted stream (``--migrate-streams false``: the error goes to the client instead). A stream of
   ``n > 1`` choices (their messages interleaved, each with its ``index``) does not move: the client gets the
   error, never a choice's tokens twice. A request that resumes a stream its client received part of through
   another router (``GenerateRequest.resume``, sent by ``kvserve.Client`` when a router fails mid-stream) starts
   as such a moved stream: the tokens it already has go to the decode worker as the continuation. When every
   worker tried was full the client gets RESOURCE_EXHAUSTED (HTTP 429), else UNAVAILABLE. A client that
   cancels cancels the decode call, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import aclosing
from typing import TypeVar

import grpc

from cluster_state.prefix_index import Held
from cluster_state.registry import Registry
from cluster_state.workers import Role, WorkerInfo
from engine.tokenizer import Tokenizer
from kvstore.prefix_hash import block_hashes
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.fair_queue import FairQueue, Hold
from router.health import WorkerHealth
from router.limits import ADMITTED
from router.relay import Relayed, Slot
from router.routing import RoutingWeights, choose
from router.tenants import ANONYMOUS
from router.validation_queue import DEFAULT_MAX_BACKLOG, ValidationBusy, ValidationQueue
from rpc import metrics, tracing
from rpc.convert import sampling_to_proto
from rpc.streams import cancel_when_stalled
from rpc.validation import validate_resume
from security.auth import Security
from security.identity import Identity

log = logging.getLogger(__name__)
# A stream that already sent tokens continues on another decode worker after these: the worker died
# (UNAVAILABLE) or drained (it ends what is left at its drain timeout with UNAVAILABLE).
_MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}
# UNAUTHENTICATED from a decode worker means this router's cluster token is wrong: the client is not to blame,
# so it gets UNAVAILABLE (after trying the others), not an internal service's auth error.
_RETRYABLE = _MIGRATABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
_SERVICES = {"decode": "kvserve.v1.Decode", "prefill": "kvserve.v1.Prefill"}
_T = TypeVar("_T")


class RouteError(Exception):
    """Why a request could not be served: a gRPC status and a message for the client."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Router(pb_grpc.InferenceServicer):
    """The public ``Inference`` service. Lives on one event loop: create it anywhere, serve and close it there.

    ``_in_flight`` counts the calls this router has open per worker id; every count it adds is removed by
    the ``Slot`` that added it, once (see ``Slot``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_context: int,
        security: Security,
        registry: Registry | None = None,
        decode_addresses: list[str] | None = None,
        max_attempts: int = 3,
        weights: RoutingWeights | None = None,
        migrate_streams: bool = True,
        stream_idle_timeout_s: float = 30.0,
        max_validation_backlog: int = DEFAULT_MAX_BACKLOG,
        fair_queue_slots: int = 0,
    ) -> None:
        self.security = security
        # tenants share the decode workers by weight past this many requests sent on (router.fair_queue)
        self.fair = FairQueue(lambda: fair_queue_slots) if fair_queue_slots else None
        self.registry = registry
        self.static_decode = [WorkerInfo(worker_id=a, role="decode", address=a) for a in decode_addresses or []]
        self.max_attempts = max_attempts
        self.migrate_streams = migrate_streams
        self.stream_idle_timeout_s = stream_idle_timeout_s  # a client that reads nothing this long is dropped
        self.weights = weights or RoutingWeights()
        self.health = WorkerHealth(self._channel)
        self._channels: dict[str, tuple[grpc.aio.Channel, float]] = {}  # and the worker start it was made for
        self._in_flight: Counter[str] = Counter()
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context
        self._validator = ValidationQueue(tokenizer, vocab_size, max_context, max_validation_backlog)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """The gRPC face of ``generate``: its ``RouteError`` ends the call with that status and message."""
        try:
            stream = self.generate(request, _remaining(context), context.invocation_metadata())
            async with aclosing(stream):
                async for msg in cancel_when_stalled(stream, self.stream_idle_timeout_s, f"gRPC {context.peer()}"):
                    yield msg
        except RouteError as err:
            await context.abort(err.code, err.details)

    async def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                       trace_carrier: Iterable[tuple[str, str]] | Mapping[str, str] | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        """``_route``, counted in ``kvserve_router_requests_total`` by how it ended, in a trace span whose parent
        is the client's ``traceparent`` in ``trace_carrier`` (its gRPC metadata or HTTP headers), if any."""
        status = "OK"
        admitted = ADMITTED.get()  # the front door's: the tenant, and what its request used
        tenant = admitted.tenant if admitted is not None else ANONYMOUS
        span = tracing.start("kvserve.request", trace_carrier, request_id=request.request_id or None,
                             prompt_kind=request.WhichOneof("prompt"), tenant=tenant.name)  # fmt: skip
        hold = Hold(self.fair, tenant.name, tenant.weight)
        try:
            async with aclosing(self._route(request, timeout_s, span, hold)) as stream:
                async for msg in stream:
                    if admitted is not None and msg.HasField("usage"):
                        admitted.prompt_tokens = msg.usage.prompt_tokens
                        admitted.completion_tokens = msg.usage.completion_tokens
                    yield msg
        except RouteError as err:
            status = err.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            hold.release()
            metrics.ROUTER_REQUESTS.labels(status).inc()
            span.set(status=status)
            span.end(None if status == "OK" else status)

    async def _route(self, request: pb.GenerateRequest, timeout_s: float | None, span: tracing.Span, hold: Hold
                     ) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        """Validate, route and relay one public request: the decode worker's messages, the last with
        ``finish_reason``. Every failure is a ``RouteError`` (nothing else escapes), raised before the first
        message when it is the request's fault or no worker could start it. Closing or cancelling the iterator
        cancels the decode call, which frees its blocks: both the gRPC servicer and the HTTP API consume it."""
        received = time.perf_counter()
        with span.child("router.validate") as validating:
            try:
                prompt, params = await self._validator.validate(request)
                resumed = validate_resume(request, len(prompt), params, self.vocab_size, self.max_context)
            except ValueError as err:
                raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            except ValidationBusy as err:
                raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from None
            validating.set(prompt_tokens=len(prompt), n=params.n, resumed_tokens=len(resumed.output_token_ids)
                           if resumed else 0)  # fmt: skip
        if hold.queue is not None:
            with span.child("router.fair_queue", tenant=hold.tenant, waiting=hold.queue.num_waiting):
                await hold.acquire(request.sampling.priority)
        with span.child("router.route") as routing:
            decode, prefill = await asyncio.gather(self._live("decode"), self._live("prefill"))
            owners, num_blocks = await asyncio.to_thread(self._prefix_owners, prompt, decode)
            choice = choose(decode, prefill, owners, num_blocks, self._load, self.weights)  # claimed with no await
            routing.set(**choice.attributes(owners, num_blocks))
        targets = choice.decode[: self.max_attempts]
        if not targets:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no decode worker is available; is the cluster up?")
        metrics.ROUTING.labels(choice.reason).inc()
        if resumed:
            metrics.RESUMED.inc()
        errors, relayed = [], Relayed(resumed)
        with self._claim(choice.prefill) as prefill_slot:
            call_request = pb.DecodeRequest(request_id=request.request_id or uuid.uuid4().hex,
                                            prompt_token_ids=prompt, sampling=sampling_to_proto(params),
                                            preferred_prefill_worker=prefill_slot.key)  # fmt: skip
            if request.sampling.HasField("priority") or hold.queue is not None:  # (the workers' queue order)
                call_request.sampling.priority = hold.worker_priority(request.sampling.priority)
            for worker in targets:
                with self._claim(worker.worker_id):
                    relayed.resume(call_request)
                    calling = span.child("router.decode_call", decode_worker=worker.worker_id,
                                         resumed_tokens=len(relayed.tokens))  # fmt: skip
                    call = pb_grpc.DecodeStub(self._channel(worker)).Generate(
                        call_request, timeout=timeout_s, metadata=self.security.metadata() + calling.metadata()
                    )
                    try:
                        async for msg in call:
                            prefill_slot.release()  # the prompt is prefilled once the first token exists
                            relayed.add(msg, received)
                            yield msg
                        return
                    except grpc.RpcError as err:
                        calling.end(err.code().name)
                        errors.append(self._failed(err, worker, relayed, params.n))
                        if relayed.tokens:
                            span.event("migrated", from_worker=worker.worker_id, tokens=len(relayed.tokens))
                    finally:
                        calling.end()
                        call.cancel()  # a no-op once it ended; otherwise the client left, and its blocks are freed
        # only when every worker tried was full is it the client's signal to slow down (HTTP 429)
        full = all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in errors)
        raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.UNAVAILABLE,
                         "every decode worker tried failed: " + "; ".join(text for _, text in errors))  # fmt: skip

    def _failed(self, err: grpc.RpcError, worker: WorkerInfo, relayed: Relayed, n: int) -> tuple[grpc.StatusCode, str]:
        """A decode call that failed: ``RouteError`` when the stream cannot go on elsewhere, else (its code, a
        line saying what happened) and the stream tries the next worker (migrating what was relayed)."""
        migratable = _MIGRATABLE if self.migrate_streams else set()
        if err.code() not in _RETRYABLE or (relayed.tokens and err.code() not in migratable):
            raise RouteError(err.code(), err.details() or "decode worker failed") from None
        if relayed.tokens and n > 1:  # its choices' streams do not move: end it honestly
            raise RouteError(err.code(), f"decode worker {worker.worker_id} failed after streaming part of {n} "
                             "choices; a stream of several choices does not move to another worker: retry the "
                             "request") from None  # fmt: skip
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            self.health.bench(worker)
        if relayed.tokens:
            metrics.MIGRATIONS.inc()
            log.warning("decode worker %s failed after %d tokens (%s); moving the stream to another",
                        worker.worker_id, len(relayed.tokens), err.code().name)  # fmt: skip
        else:
            log.warning("decode worker %s failed before its first token (%s); trying another",
                        worker.worker_id, err.code().name)  # fmt: skip
        return err.code(), f"{worker.worker_id}: {err.code().name} {err.details()}"

    async def run_tokenizer(self, num_chars: int, work: Callable[[], _T]) -> _T:
        """``work()``, which uses ``tokenizer``, on the validation thread (``ValidationQueue.run``): the HTTP
        API's ``/tokenize`` and ``/detokenize``. ``ValidationBusy`` when its backlog is full."""
        return await self._validator.run(num_chars, work)

    async def ready(self) -> bool:
        """Whether a decode worker answers health checks now (the HTTP ``/health``)."""
        return bool(await self._live("decode"))

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._validator.close()

    async def _live(self, role: Role) -> list[WorkerInfo]:
        """The workers of ``role`` that answer health checks, by id: those registered now, those registered
        before that Redis lost (``WorkerHealth``), else the static decode workers."""
        workers = await asyncio.to_thread(self.registry.workers, role) if self.registry is not None else []
        workers = sorted(workers, key=lambda w: w.worker_id)
        if not workers and role == "decode":
            workers = self.static_decode
        return await self.health.usable(workers, _SERVICES[role])

    def _load(self, worker: WorkerInfo) -> int:
        """A worker's load: what it last reported, or what this router has sent it since, whichever is more.

        Heartbeats are seconds apart; without counting its own calls the router would send a whole
        burst to the worker that looked idle at the last heartbeat.
        """
        return max(worker.num_running + worker.num_waiting, self._in_flight[worker.worker_id])

    def _prefix_owners(self, prompt: list[int], decode: list[WorkerInfo]) -> tuple[dict[str, Held], int]:
        """(worker id -> leading full blocks of ``prompt`` it holds by tier, the prompt's blocks incl. a partial tail),
        hashed the way the workers' engines hash (their fingerprint and block size); one Redis round trip."""
        layout = next((w for w in decode if w.block_size), None)
        if layout is None:
            return {}, 1
        num_blocks = -(-len(prompt) // layout.block_size)
        if self.registry is None:
            return {}, num_blocks
        # the hashes are salted with the layout's fingerprint: only workers of that layout can hold them
        chain = block_hashes(prompt, layout.block_size, layout.fingerprint)
        return self.registry.prefix_index.holdings(chain), num_blocks

    def _claim(self, worker_id: str) -> Slot:
        """Count a call to ``worker_id`` as in flight until the slot is released (``with`` releases it)."""
        return Slot(self._in_flight, worker_id)

    def _channel(self, worker: WorkerInfo) -> grpc.aio.Channel:
        """The channel to ``worker``; with cluster certificates TLS accepts only a server whose certificate names
        it (a static ``--decode-address`` names no worker: any decode worker of the cluster CA then)."""
        name = "" if worker.worker_id == worker.address else worker.worker_id
        key = f"{worker.address} {name}"
        channel, started_at = self._channels.get(key, (None, None))
        if channel is None or worker.started_at > started_at:
            # a newer start of the worker gets a new channel: the old one may sit in reconnect backoff, failing the
            # first calls to the new process. A request still holding the older description uses the newest one.
            if channel is not None:
                asyncio.ensure_future(channel.close())
            channel = self.security.aio_channel(worker.address, Identity(worker.role, name))
            self._channels[key] = (channel, worker.started_at)
        return channel


def _remaining(context: grpc.aio.ServicerContext) -> float | None:
    """The client's deadline as a timeout for the call we make on its behalf (None: it set none)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e6 else None
