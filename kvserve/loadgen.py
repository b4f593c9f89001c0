"""A closed-loop load driver for a running cluster: ``concurrency`` asyncio workers send requests through the
router's public API (``grpc.aio``) and record, per request, its status, time to first token, end-to-end
latency and tokens. It drives the soak and the reliability measurements in ``scripts/reliability.py``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from kvserve.client import build_request
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


@dataclass
class Record:
    start: float  # seconds since the run began
    status: str = "OK"  # gRPC status name
    detail: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class LoadResult:
    records: list[Record]
    duration_s: float

    @property
    def errors(self) -> Counter:
        return Counter(r.status for r in self.records if r.status != "OK")

    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "OK"]

    def percentile(self, name: str, q: float) -> float:
        values = sorted(getattr(r, name) for r in self.ok())
        if not values:
            return math.nan
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]

    def summary(self) -> str:
        ok = self.ok()
        tokens = sum(r.num_tokens for r in ok)
        lines = [f"{len(self.records)} requests in {self.duration_s:.1f} s: {len(ok)} ok, errors {dict(self.errors)}",
                 f"throughput {len(ok) / self.duration_s:.2f} req/s, {tokens / self.duration_s:.1f} tok/s"]  # fmt: skip
        for name in ("ttft_s", "e2e_s"):
            p50, p90, p99 = (self.percentile(name, q) * 1000 for q in (50, 90, 99))
            lines.append(f"{name[:-2]:>5} ms: p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f}")
        return "\n".join(lines)


async def _one(stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, record: Record, t0: float,
               timeout_s: float) -> None:  # fmt: skip
    try:
        async for msg in stub.Generate(request, timeout=timeout_s):
            if msg.token_ids and math.isnan(record.ttft_s):
                record.ttft_s = time.perf_counter() - t0 - record.start
            record.token_ids.extend(msg.token_ids)
    except grpc.aio.AioRpcError as err:
        record.status, record.detail = err.code().name, err.details() or ""
    record.e2e_s = time.perf_counter() - t0 - record.start
    record.num_tokens = len(record.token_ids)


async def run_load(target: str, prompts: list, concurrency: int, timeout_s: float = 300.0,
                   **options) -> LoadResult:  # fmt: skip
    """Send one request per prompt (``options`` as ``kvserve.client.build_request`` takes them), at most
    ``concurrency`` in flight, in order; every request gets a ``Record``, failed ones included."""
    records: list[Record] = []
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                record = Record(start=time.perf_counter() - t0)
                records.append(record)
                await _one(stub, build_request(prompt, **options), record, t0, timeout_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(records, time.perf_counter() - t0)
