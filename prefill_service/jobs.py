"""A prefill job as the batcher holds it, the queue of them, its result, and how its caller is answered."""

from __future__ import annotations

import queue
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from engine import SamplingParams
from engine.logprobs import TokenLogprob
from engine.priorities import insert_by_priority
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc import metrics
from transfer.interface import KVTransport


class LeaseExpired(RuntimeError):
    """The job's lease ran out (less the margin) before its prompt was done: nothing more was read or written
    at the destination from then on, and the job failed."""


@dataclass
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    destination: pb.KVDestination
    transport: KVTransport  # how the KV reaches the destination: its ``pool`` is written in place, if any
    dest_cached_tokens: int = 0  # leading prompt tokens the destination already holds: not written there
    write_until: float = float("inf")  # time.monotonic() from which the destination is neither read nor written
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # the caller gave up: never start it, or stop it at the next step
    writes_ended: bool = False  # we will never write into the destination's pool for it again, and said so
    priority: int = 0  # lower first: the queue's order, then arrival (``JobQueue``)
    num_overtaken: int = 0  # later arrivals of a higher priority queued ahead of it (``JobQueue``)

    @property
    def expired(self) -> bool:
        return self.transport.backend.writes_in_place and time.monotonic() >= self.write_until


class JobQueue(queue.Queue):
    """The worker's waiting jobs, taken by priority, then arrival (a thread-safe queue), with the decode side's
    starvation bound: a job is passed by at most ``engine.priorities.MAX_OVERTAKEN`` later arrivals of a higher
    priority, and the ones after them queue behind it (``insert_by_priority``)."""

    def _init(self, maxsize: int) -> None:  # (queue.Queue's hooks, called under its lock)
        self.queue: deque[PrefillJob] = deque()

    def _put(self, job: PrefillJob) -> None:
        insert_by_priority(self.queue, job, bounded=True)

    def _get(self) -> PrefillJob:
        return self.queue.popleft()

    def put_job(self, job: PrefillJob) -> None:
        self.put(job)

    def get_job(self, timeout: float | None = None) -> PrefillJob:
        """The next job; ``queue.Empty`` when none came within ``timeout`` (0: none waiting now)."""
        return self.get(timeout=timeout) if timeout else self.get_nowait()


@dataclass
class PrefillResult:
    first_token: int
    taken: object  # what the transport still moves after the step: ``KVTransport.take`` of the blocks it lacks
    prefill_ms: float  # from the batch's start to the step that finished the prompt
    num_cached_tokens: int  # leading prompt tokens taken from our own prefix cache
    take_ms: float = 0.0  # ``take`` after that step (the whole write, for nixl): part of the hand-off's time
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # when it asked for prompt_logprobs: tokens 1, 2, ...
    started: float = 0.0  # its batch's start (time.perf_counter): the job waited in the queue until then
    num_steps: int = 0  # engine steps (chunks) until its prompt was done
    num_tier_tokens: int = 0  # leading prompt tokens a memory tier loaded


def settle(job: PrefillJob, result: PrefillResult | None = None, error: BaseException | None = None) -> None:
    """Answer a job's caller once; a caller that cancelled (its future is cancelled) gets nothing."""
    try:
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
    except InvalidStateError:
        return
    metrics.REQUESTS.labels("prefill", "failed" if error is not None else "finished").inc()
