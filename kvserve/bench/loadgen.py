"""The one load engine: sends ``BenchRequest``s to a running cluster through its public API (gRPC or the
OpenAI-compatible HTTP API, ``kvserve.bench.backends``) on one asyncio loop and records every request.

Arrivals are open-loop: request *i* is sent at its arrival time whatever happened to the earlier ones. The
gaps between arrivals are drawn from a gamma distribution of shape ``burstiness`` and mean ``1 / rate``
(shape 1 is a Poisson process; below 1 burstier, above 1 steadier; vLLM's ``bench serve`` does the same);
an infinite rate sends everything at once. ``max_concurrency`` caps the requests in flight: an arrival waits
for a free slot, so a rate of infinity with a cap is a closed loop of that many clients (what
``scripts/reliability.py`` runs). The run ends after ``num_requests`` requests, or once ``duration_s`` has
passed (no new request is sent after it; those in flight finish).

Every request gets a ``Record`` in the order sent, failed ones included, with its gRPC status name. Each
record also keeps how late its send was against its arrival time (the event loop's lag) and the time spent
in this client's own code (building the request, handling each streamed message); the run keeps the
process's CPU time. Those three say whether the client, not the server, is the bottleneck.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from kvserve.bench.backends import Backend, GrpcBackend
from rpc.requests import Prompt


@dataclass(frozen=True)
class BenchRequest:
    prompt: Prompt
    max_tokens: int
    num_prompt_tokens: int = 0  # known in advance (datasets); the server's count replaces it when it answers


@dataclass
class Record:
    """One request. Times are seconds; ``start`` counts from the run's start, the others from ``start``."""

    start: float
    lag_s: float = 0.0  # how late the send was against its arrival time (never the wait for a free slot)
    status: str = "OK"  # gRPC status name ("HTTP_<code>" for an HTTP error that names none)
    detail: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    chunk_s: list[float] = field(default_factory=list)  # when each streamed message with tokens arrived
    chunk_tokens: list[int] = field(default_factory=list)  # its token count (1 per text chunk over HTTP)
    num_tokens: int = 0  # output tokens, as the server counted them
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # gRPC only
    client_s: float = 0.0  # time in this client's own code for this request

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (NaN with fewer than two tokens)."""
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1) if self.num_tokens > 1 else math.nan

    def itl_s(self) -> list[float]:
        """Gaps between consecutive streamed messages."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


@dataclass
class LoadResult:
    records: list[Record]
    duration_s: float  # first send to last answer
    cpu_s: float = 0.0  # this process's CPU time over the run (every thread)

    @property
    def errors(self) -> Counter:
        return Counter(r.status for r in self.records if not r.ok)

    def ok(self) -> list[Record]:
        return [r for r in self.records if r.ok]

    def percentile(self, name: str, q: float) -> float:
        """The ``q``-th percentile of a ``Record`` attribute over the successful requests (nearest rank)."""
        values = sorted(getattr(r, name) for r in self.ok())
        if not values:
            return math.nan
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]

    def summary(self) -> str:
        """Three lines: counts, throughput, TTFT and end-to-end percentiles (the full report: ``bench.load``)."""
        ok = self.ok()
        tokens = sum(r.num_tokens for r in ok)
        lines = [f"{len(self.records)} requests in {self.duration_s:.1f} s: {len(ok)} ok, errors {dict(self.errors)}",
                 f"throughput {len(ok) / self.duration_s:.2f} req/s, {tokens / self.duration_s:.1f} tok/s"]  # fmt: skip
        for name in ("ttft_s", "e2e_s"):
            p50, p90, p99 = (self.percentile(name, q) * 1000 for q in (50, 90, 99))
            lines.append(f"{name[:-2]:>5} ms: p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f}")
        return "\n".join(lines)


def arrival_gaps(rate: float, burstiness: float, rng: random.Random):
    """Seconds between consecutive arrivals, forever: gamma(shape ``burstiness``, mean ``1 / rate``)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def run_load(target: str, requests: list[BenchRequest], *, num_requests: int | None = None,
                   duration_s: float | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, backend: Backend | None = None,
                   sampling: dict | None = None, timeout_s: float = 300.0,
                   progress: bool = False) -> LoadResult:  # fmt: skip
    """Send ``requests`` in order (cycling when ``num_requests`` or ``duration_s`` asks for more) and wait for all.

    ``num_requests`` defaults to ``len(requests)`` unless ``duration_s`` is given. ``sampling`` holds the
    options every request shares (``temperature``, ``ignore_eos``, ...); ``backend`` defaults to gRPC.
    """
    if not requests:
        raise ValueError("no requests to send")
    if num_requests is None and duration_s is None:
        num_requests = len(requests)
    backend = backend or GrpcBackend()
    gaps = arrival_gaps(request_rate, burstiness, random.Random(seed))
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[Record] = []
    tasks: list[asyncio.Task] = []
    bar = tqdm(total=num_requests, disable=not progress, unit="req", dynamic_ncols=True)
    async with backend.connect(target, sampling or {}, timeout_s) as send:

        async def one(request: BenchRequest, record: Record) -> None:
            try:
                await send(request, record)
            finally:
                if slots is not None:
                    slots.release()
                bar.update(1)

        cpu0, t0 = time.process_time(), time.perf_counter()
        arrival, last_slot = 0.0, t0
        while num_requests is None or len(records) < num_requests:
            arrival += next(gaps) if records else 0.0
            if duration_s is not None and arrival > duration_s:
                break
            due = max(t0 + arrival, last_slot)  # an arrival held back by the concurrency cap is due once it got in
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            lag = max(0.0, time.perf_counter() - due)
            if slots is not None:
                await slots.acquire()
                last_slot = time.perf_counter()
            if duration_s is not None and time.perf_counter() - t0 > duration_s:
                if slots is not None:
                    slots.release()
                break
            record = Record(start=time.perf_counter() - t0, lag_s=lag)
            records.append(record)
            tasks.append(asyncio.create_task(one(requests[(len(records) - 1) % len(requests)], record)))
        await asyncio.gather(*tasks)
        end, cpu1 = time.perf_counter(), time.process_time()
    bar.close()
    first = records[0].start if records else 0.0
    return LoadResult(records, max(1e-9, end - t0 - first), cpu1 - cpu0)
