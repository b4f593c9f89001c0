"""A workload replayed on one engine at a request rate, on a virtual clock: what ``kvserve tune`` measures.

Requests arrive open-loop (Poisson at ``rate``; all at once for ``inf``). The clock advances by each engine
step's wall time and jumps over the gaps in which the engine has nothing to do, so a low rate costs no idle
waiting and every latency is the engine's own: a request's TTFT is from its arrival to the end of the step
that made its first token (arrivals during a step wait for the next one, as they would in a worker), its TPOT
the mean time per output token after the first. Requests decode greedily with EOS ignored, so each runs to
its ``max_tokens``; their KV use is sampled after every step, against the sequences running then.

A replay's arrivals are one pattern of gaps drawn from ``seed``, divided by the rate: two rates replayed with one
seed see the same bursts and lulls, compressed, so the latencies a search compares grow with the rate and not with
the luck of the draw (``Slo`` says when a replay meets the SLO).

Each replay's prompts begin with a token (or, for text, a line) of their own, so that no replay finds the
prompts of an earlier one in the engine's prefix cache: what is shared inside one replay (``shared-prefix``'s
system prompts) stays shared, and every rate of a ladder runs on the same engine as cold as the first.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from engine import LLMEngine, SamplingParams
from kvserve.bench.loadgen import BenchRequest, arrival_gaps

_SALTS = itertools.count(1)
_FIRST_SALT_TOKEN = 100  # clear of the special tokens at the bottom of the vocabulary (as the datasets are)


@dataclass(frozen=True)
class Slo:
    """A service-level objective as DistServe defines goodput's: a request meets it when its TTFT is at most
    ``ttft_s`` and its TPOT at most ``tpot_s``; a replay meets it when at least ``attainment`` of its requests
    do. A fraction, not a p99 of each: over the tens of requests a replay has, a p99 is their maximum, and one
    slow step would decide it."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the SLO's {name[:4].upper()} bound must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")

    def describe(self) -> str:
        return f"{self.attainment:.0%} of requests within TTFT {self.ttft_s:g} s and TPOT {self.tpot_s:g} s"


@dataclass
class RatePoint:
    """One replay's figures; latencies in seconds, one entry per request in the order they finished (TPOT NaN
    for a request of one output token)."""

    rate: float  # requests per second asked for
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    span_s: float = 0.0  # first arrival to last token, on the virtual clock
    kv_samples: list[tuple[int, int]] = field(default_factory=list)  # (sequences running, KV bytes in use)

    def p(self, what: str, q: float) -> float:
        values = [v for v in (self.ttft_s if what == "ttft" else self.tpot_s) if not math.isnan(v)]
        return float(np.percentile(values, q)) if values else math.nan

    @property
    def request_throughput(self) -> float:
        return len(self.ttft_s) / self.span_s if self.span_s else 0.0

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.span_s if self.span_s else 0.0

    @property
    def peak_kv_bytes(self) -> int:
        return max((b for _, b in self.kv_samples), default=0)

    def attainment(self, slo: Slo) -> float:
        """The fraction of requests within both of the SLO's bounds (0 for a replay of none)."""
        pairs = zip(self.ttft_s, self.tpot_s, strict=True)
        within = [ttft <= slo.ttft_s and not tpot > slo.tpot_s for ttft, tpot in pairs]  # NaN TPOT: one token
        return sum(within) / len(within) if within else 0.0

    def meets(self, slo: Slo) -> bool:
        return self.attainment(slo) >= slo.attainment

    def summary(self, slo: Slo | None = None) -> dict[str, float]:
        figures = {"rate": self.rate, "request_throughput": self.request_throughput,
                   "output_throughput": self.output_throughput, "peak_kv_bytes": self.peak_kv_bytes}
        for what in ("ttft", "tpot"):
            figures |= {f"{what}_p{q}_ms": self.p(what, q) * 1e3 for q in (50, 90, 99)}
        if slo is not None:
            figures["attainment"] = self.attainment(slo)
        return figures


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` per second: the pattern of ``seed`` at 1 per second, divided by the rate."""
    gaps = arrival_gaps(1.0, 1.0, random.Random(seed))
    return [float(t) / rate for t in np.cumsum([next(gaps) for _ in range(count)])]


def replay(engine: LLMEngine, requests: list[BenchRequest], rate: float, seed: int = 0) -> RatePoint:
    """Run ``requests`` through ``engine`` (empty, and left empty) at ``rate`` requests per second, on the
    arrival pattern of ``seed`` (the same pattern at every rate)."""
    arrivals = arrival_times(len(requests), rate, seed)
    bytes_per_block = engine.runner.kv_cache.spec.bytes_per_block()
    pool = engine.block_manager.pool
    salt = next(_SALTS)
    point, clock, sent = RatePoint(rate), 0.0, 0
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    while sent < len(requests) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock = max(clock, arrivals[sent])  # nothing to run until the next arrival
        while sent < len(requests) and arrivals[sent] <= clock:
            request = requests[sent]
            params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
            prompt = f"[{salt}]\n{request.prompt}" if isinstance(request.prompt, str) else [
                _FIRST_SALT_TOKEN + salt % (engine.model_config.vocab_size - _FIRST_SALT_TOKEN), *request.prompt]
            arrived[engine.add_request(prompt, params, f"tune-{salt}-{sent}")] = arrivals[sent]
            sent += 1
        start = time.perf_counter()
        outputs = engine.step()
        clock += time.perf_counter() - start
        point.kv_samples.append((len(engine.scheduler.running), (pool.num_blocks - pool.num_free_blocks)
                                 * bytes_per_block))  # fmt: skip
        for out in outputs:
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = clock
            if out.finished:
                begun = arrived[out.request_id]
                point.ttft_s.append(first_token[out.request_id] - begun)
                tokens_after_first = out.num_output_tokens - 1
                point.tpot_s.append((clock - first_token[out.request_id]) / tokens_after_first
                                    if tokens_after_first else math.nan)  # fmt: skip
                point.num_output_tokens += out.num_output_tokens
    point.span_s = clock - (arrivals[0] if arrivals else 0.0)
    return point
