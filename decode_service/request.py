"""A request's state on the decode worker: one explicit state, and the transitions it may take.

    QUEUED -> PREFILLING -> RUNNING -> FINISHED
      |  ^         |            |
      |  +---------+ (retry)    +--> ABORTED / FAILED
      +--> RUNNING (local)
    any non-terminal state --> ABORTED / FAILED

QUEUED waits in the engine's scheduler for blocks (the scheduler admits it);
PREFILLING holds blocks a prefill worker is filling (the scheduler's
WAITING_FOR_REMOTE_KV); RUNNING without a PREFILLING phase is a local prefill
(no prefill worker, or all of them failed).
FINISHED, ABORTED and FAILED are terminal: the worker's one cleanup
(``DecodeWorker._finish``) moves a request there and frees what it holds.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from cluster_state.workers import WorkerInfo
from engine import Continuation, LLMEngine, RequestOutput, SamplingParams
from engine.continuation import check_continuation
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc import metrics
from rpc.convert import logprobs_to_proto
from rpc.tracing import NO_SPAN, Span
from rpc.validation import validate_request_id, validate_sampling
from transfer.backend import LOCAL


class RequestState(enum.Enum):
    QUEUED = "queued"  # accepted, waiting in the engine's scheduler for KV blocks
    PREFILLING = "prefilling"  # a prefill worker is writing the prompt's KV into the reserved blocks
    RUNNING = "running"  # in the engine's batch (decoding, or prefilling locally)
    FINISHED = "finished"
    ABORTED = "aborted"  # the client went away, or cancelled
    FAILED = "failed"  # ended with an error status

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)


_ALLOWED = {
    RequestState.QUEUED: {RequestState.PREFILLING, RequestState.RUNNING},
    RequestState.PREFILLING: {RequestState.RUNNING, RequestState.QUEUED},
    RequestState.RUNNING: {RequestState.FINISHED},
}


@dataclass(eq=False)
class ActiveRequest:
    """One ``Generate`` call. The engine loop owns every field but ``outputs``, which the stream reads.

    ``outputs`` lives on the gRPC event loop: the engine loop feeds it through ``emit`` (thread-safe) with
    ``GenerateResponse`` messages, then exactly one terminal item: ``None`` (done) or ``(status, message)``.
    """

    request_id: str  # unique inside this worker; the client's id travels in ``public_id``
    public_id: str
    prompt: list[int]
    params: SamplingParams
    event_loop: asyncio.AbstractEventLoop
    preferred_prefill: str = ""
    continuation: Continuation | None = None  # output another decode worker streamed before it died or drained
    priority: int = 0  # lower first: its place in our engine's queue and in the prefill worker's
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.QUEUED
    admitted: bool = False  # the scheduler gave it blocks once (it left the worker's waiting count)
    target: WorkerInfo | None = None  # the prefill worker chosen for its next prefill
    future: Future | None = None  # the in-flight prefill call
    prefill_worker: str = ""
    prefill_address: str = ""  # where that worker serves (to tell whether it is still there)
    backend: str = LOCAL  # a transfer.backend.Backend once a prefill worker is asked; LOCAL: prefilled here
    lease_deadline: float = 0.0
    tried: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # leading prompt tokens found in our own prefix cache (whole blocks)
    leased: list[int] = field(default_factory=list)  # the blocks after them, leased to the prefill worker
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prefill_sent_at: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    num_finished: int = 0  # of its ``params.n`` choices (``engine.parallel_sampling``)
    num_completion_tokens: int = 0  # of its finished choices
    started: set[int] = field(default_factory=set)  # the choices that sent a message
    prompt_entries: list[pb.TokenLogprob] = field(default_factory=list)  # ``prompt_logprobs``, from choice 0
    span: Span = NO_SPAN  # this call's trace span (``rpc.tracing``); its children are recorded when it ends
    prefill_span: Span = NO_SPAN  # the prefill call in flight
    admitted_at: float = 0.0  # when the scheduler gave it blocks
    num_messages: int = 0
    num_preemptions: int = 0  # of its finished choices
    spec_tokens: tuple[int, int] = (0, 0)  # (proposed, accepted) speculative tokens of its finished choices

    @property
    def done(self) -> bool:
        """Whether every choice has finished."""
        return self.num_finished == self.params.n

    @property
    def tokens(self) -> list[int]:
        """The tokens whose KV must be in our blocks before decoding: the prompt, then any resumed output."""
        return self.prompt + list(self.continuation.output_token_ids) if self.continuation else self.prompt

    def move(self, state: RequestState) -> None:
        """Take a non-terminal transition; terminal states are reached only through ``end``."""
        if state not in _ALLOWED.get(self.state, ()):
            raise ValueError(f"request {self.request_id}: no transition {self.state.value} -> {state.value}")
        self.state = state

    def emit(self, item: object) -> None:
        """Hand a stream item to the gRPC side (from any thread)."""
        self.event_loop.call_soon_threadsafe(self.outputs.put_nowait, item)

    def end(self, state: RequestState, error: tuple[grpc.StatusCode, str] | None = None) -> None:
        """Enter a terminal state and close the stream (with ``error`` as its status, if any). Once only."""
        if not state.terminal:
            raise ValueError(f"{state.value} is not a terminal state")
        if self.state.terminal:
            return
        self.state = state
        metrics.REQUESTS.labels("decode", state.value).inc()
        self.emit(error)
        self._end_span(state, error)

    def _end_span(self, state: RequestState, error: tuple[grpc.StatusCode, str] | None) -> None:
        """The call's span ends, with its queue and decode phases recorded from the times kept meanwhile."""
        span, now = self.span, time.perf_counter()
        if not span:
            return
        self.prefill_span.end("the request ended while its prefill was in flight")
        span.record("decode.queue", self.received, self.admitted_at or now, admitted=bool(self.admitted_at))
        if self.first_token_at is not None:
            span.event("first_token", self.first_token_at, ttft_ms=(self.first_token_at - self.received) * 1e3)
            span.record("decode.decode", self.first_token_at, self.last_token_at, messages=self.num_messages,
                        completion_tokens=self.num_completion_tokens, preemptions=self.num_preemptions,
                        spec_proposed_tokens=self.spec_tokens[0], spec_accepted_tokens=self.spec_tokens[1])  # fmt: skip
        span.set(state=state.value, cached_prompt_tokens=self.num_cached_tokens, backend=self.backend,
                 prefill_worker=self.prefill_worker or None)  # fmt: skip
        span.end(f"{error[0].name}: {error[1]}" if error else None)

    def _add_prompt_logprobs(self, msg: pb.GenerateResponse, out: RequestOutput) -> None:
        """A choice's first message carries the prompt's log-probabilities when asked (a continuation's went
        before); choice 0 computed them (``engine.parallel_sampling``), the others repeat them."""
        if self.params.prompt_logprobs is None or self.continuation is not None:
            return
        if out.prompt_logprobs is not None:
            self.prompt_entries = logprobs_to_proto(out.prompt_logprobs[1:])
        msg.prompt_logprobs.extend(self.prompt_entries)
        msg.prompt_token_ids.extend(out.prompt_token_ids)

    def response(self, out: RequestOutput, worker_id: str) -> pb.GenerateResponse:
        """The stream message for ``out`` (choice ``out.index``); each choice's last has its finish reason, and the
        stream's last (the last choice's) carries usage (the prompt once, every choice's completion), timings
        and who served the request."""
        now = time.perf_counter()
        first = self.first_token_at is None
        if first:
            self.first_token_at = now
            metrics.TTFT.observe(now - self.received)
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)  # ours, or a local prefill's
            metrics.PREFIX_QUERIES.labels("decode").inc(len(self.prompt))
            metrics.PREFIX_HITS.labels("decode").inc(self.num_cached_tokens)
        elif out.new_token_ids:  # a speculative verify step may emit several: each gets its share of the gap
            gap = (now - self.last_token_at) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                metrics.ITL.observe(gap)
        self.last_token_at = now
        self.num_messages += 1
        msg = pb.GenerateResponse(request_id=self.public_id, token_ids=out.new_token_ids, text=out.new_text,
                                  index=out.index)  # fmt: skip
        if out.new_logprobs is not None:
            msg.logprobs.extend(logprobs_to_proto(out.new_logprobs))
        if out.index not in self.started:
            self.started.add(out.index)
            self._add_prompt_logprobs(msg, out)
        if out.finished:
            msg.finish_reason = out.finish_reason or ""
            self.num_finished += 1
            self.num_completion_tokens += out.num_output_tokens
            self.num_preemptions += out.num_preemptions
            proposed, accepted = out.spec_tokens
            self.spec_tokens = (self.spec_tokens[0] + proposed, self.spec_tokens[1] + accepted)
        if out.finished and self.done:
            msg.usage.prompt_tokens = len(self.prompt)
            msg.usage.completion_tokens = self.num_completion_tokens
            msg.usage.cached_prompt_tokens = self.num_cached_tokens
            msg.timings.ttft_ms = (self.first_token_at - self.received) * 1000
            msg.timings.total_ms = (now - self.received) * 1000
            metrics.E2E.observe(now - self.received)
            if out.num_output_tokens > 1:
                metrics.TPOT.observe((now - self.first_token_at) / (out.num_output_tokens - 1))
            msg.timings.prefill_ms = self.prefill_ms
            msg.timings.transfer_ms = self.transfer_ms
            msg.transfer_backend = self.backend
            msg.decode_worker = worker_id
            msg.prefill_worker = self.prefill_worker
        return msg


def validate_decode_request(request: pb.DecodeRequest, engine: LLMEngine
                            ) -> tuple[list[int], SamplingParams, Continuation | None]:  # fmt: skip
    """(prompt, sampling, the continuation of a stream another decode worker began, if any) of a ``Generate``
    call, checked by the router's rules (``rpc.validation``) and the engine's; ``ValueError`` says what is
    wrong."""
    validate_request_id(request.request_id)
    params = validate_sampling(request.sampling, engine.model_config.vocab_size)
    prompt = engine.validate(list(request.prompt_token_ids), params)
    continuation = None
    if request.resumed_output_token_ids:  # a stream the router moved here from a worker that died or drained
        if params.n > 1:
            raise ValueError(f"a continuation resumes one stream; it cannot have n={params.n} choices")
        continuation = Continuation(tuple(request.resumed_output_token_ids), request.num_resumed_chars)
        vocab_size = engine.model_config.vocab_size
        check_continuation(continuation, len(prompt), params, vocab_size, engine.max_len_for(params))
    return prompt, params, continuation


class Admission:
    """Counts requests admitted and not yet holding blocks; refuses new ones past ``limit`` (any thread)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_waiting = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self.num_waiting >= self.limit:
                return False
            self.num_waiting += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.num_waiting -= 1
