"""Disaggregation overhead: TTFT and TPOT through a local 1P+1D cluster vs the offline engine, same prompts.

    kvserve bench serve [--num-prompts 8] [--prompt-len 256] [--max-tokens 32] [--backend shm|grpc]

Requests go one at a time, so the figures are latencies, not throughput. The offline engine runs in
this process; the cluster's workers run as separate processes on the same cores. Each prompt goes to
the offline engine and then to the cluster, alternating, so that both see the machine in the same state.
"""

from __future__ import annotations

import argparse
import time

from kvserve.bench.offline import make_prompts
from kvserve.bench.report import median, table


def _offline_engine():
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(model="default", num_blocks=512)
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _time_offline(engine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    from engine import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        first = first or time.perf_counter()
    end = time.perf_counter()
    return (first - start) * 1e3, (end - first) * 1e3 / (max_tokens - 1)


def _time_served(client, prompt: list[int], max_tokens: int) -> tuple[tuple[float, float], object]:
    start = time.perf_counter()
    first = last = None
    for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        first = first or time.perf_counter()
        last = chunk
    end = time.perf_counter()
    return ((first - start) * 1e3, (end - first) * 1e3 / (max_tokens - 1)), last


def _run(prompts: list[list[int]], max_tokens: int, backend: str):
    """Each prompt offline, then through the cluster, alternating, so both see the same machine."""
    from kvserve.client import Client
    from kvserve.cluster import start_cluster

    cluster = start_cluster(port=50351, engine_argv=["--model", "default", "--num-blocks", "512"],
                            decode_argv=["--transfer-backend", backend])  # fmt: skip
    offline, served, lasts = [], [], []
    try:
        engine = _offline_engine()
        with Client(cluster.endpoint, timeout_s=300) as client:
            client.generate(prompts[0][:8], max_tokens=2, temperature=0)  # warm-up
            for prompt in prompts:
                offline.append(_time_offline(engine, prompt, max_tokens))
                timing, last = _time_served(client, prompt, max_tokens)
                served.append(timing)
                lasts.append(last)
    finally:
        cluster.stop()
    return offline, served, lasts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--backend", choices=["shm", "grpc"], default="shm")
    args = parser.parse_args(argv)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len, 49152, seed=1)
    offline, served, lasts = _run(prompts, args.max_tokens, args.backend)
    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens, one at a time")
    off_ttft, off_tpot = median(t for t, _ in offline), median(p for _, p in offline)
    srv_ttft, srv_tpot = median(t for t, _ in served), median(p for _, p in served)
    rows = [("offline engine", off_ttft, off_tpot), (f"1P+1D cluster ({args.backend})", srv_ttft, srv_tpot),
            ("ratio cluster/offline", srv_ttft / off_ttft, srv_tpot / off_tpot)]
    print(table(("median", "TTFT ms", "TPOT ms"), rows))
    prefill = median(x.timings["prefill_ms"] for x in lasts)
    transfer = median(x.timings["transfer_ms"] for x in lasts)
    print(f"cluster TTFT parts (median): prefill batch {prefill:.1f} ms, KV hand-off after prefill {transfer:.1f} ms, "
          f"backend {lasts[0].transfer_backend}")  # fmt: skip
