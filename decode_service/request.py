"""A request's state on the decode worker: one explicit state, and the transitions it may take.

    QUEUED -> RESERVED -> PREFILLING -> RUNNING -> FINISHED
       |          |            |  ^         |
       |          +--> RUNNING |  | (retry) +--> ABORTED / FAILED
       +--> ABORTED / FAILED   +--+--> ABORTED / FAILED

RESERVED holds blocks for a prompt another worker will prefill; RUNNING without a
PREFILLING phase is a local prefill (no prefill worker, or all of them failed).
FINISHED, ABORTED and FAILED are terminal: the worker's one cleanup
(``DecodeWorker._finish``) moves a request there and frees what it holds.
"""

from __future__ import annotations

import asyncio
import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from engine import SamplingParams


class RequestState(enum.Enum):
    QUEUED = "queued"  # admitted, waiting for KV blocks
    RESERVED = "reserved"  # blocks held, prefill not yet sent
    PREFILLING = "prefilling"  # a prefill worker is writing the prompt's KV into the reserved blocks
    RUNNING = "running"  # in the engine's batch (decoding, or prefilling locally)
    FINISHED = "finished"
    ABORTED = "aborted"  # the client went away, or cancelled
    FAILED = "failed"  # ended with an error status

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)


_ALLOWED = {
    RequestState.QUEUED: {RequestState.RESERVED, RequestState.RUNNING},
    RequestState.RESERVED: {RequestState.PREFILLING, RequestState.RUNNING},
    RequestState.PREFILLING: {RequestState.RUNNING, RequestState.RESERVED},
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
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.QUEUED
    cancelled: bool = False  # the client is gone: end it as soon as its blocks are safe to free
    future: Future | None = None  # the in-flight prefill call
    prefill_worker: str = ""
    backend: str = "local"
    lease_deadline: float = 0.0
    tried: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0

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
        self.emit(error)
