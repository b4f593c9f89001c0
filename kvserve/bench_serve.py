"""Disaggregation overhead: TTFT and TPOT through a local 1P+1D cluster vs the offline engine, same prompts.

    kvserve bench serve [--num-prompts 8] [--prompt-len 256] [--max-tokens 32] [--backend shm|grpc]

Requests go one at a time, so the figures are latencies, not throughput. The offline engine runs in
this process; the cluster's workers run as separate processes on the same cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.bench_offline import make_prompts


def _offline(prompts: list[list[int]], max_tokens: int) -> list[tuple[float, float]]:
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(model="default", num_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(prompts[0][:8], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    timings = []
    for prompt in prompts:
        start = time.perf_counter()
        engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        end = time.perf_counter()
        timings.append(((first - start) * 1e3, (end - first) * 1e3 / (max_tokens - 1)))
    return timings


def _cluster(prompts: list[list[int]], max_tokens: int, backend: str) -> tuple[list[tuple[float, float]], list]:
    from kvserve.client import Client
    from kvserve.cluster import start_cluster

    cluster = start_cluster(port=50351, engine_argv=["--model", "default", "--num-blocks", "512"],
                            decode_argv=["--transfer-backend", backend])  # fmt: skip
    timings, lasts = [], []
    try:
        with Client(cluster.endpoint, timeout_s=300) as client:
            client.generate(prompts[0][:8], max_tokens=2, temperature=0)  # warm-up
            for prompt in prompts:
                start = time.perf_counter()
                first = None
                for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                    first = first or time.perf_counter()
                    last = chunk
                end = time.perf_counter()
                timings.append(((first - start) * 1e3, (end - first) * 1e3 / (max_tokens - 1)))
                lasts.append(last)
    finally:
        cluster.stop()
    return timings, lasts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--backend", choices=["shm", "grpc"], default="shm")
    args = parser.parse_args(argv)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len, 49152, seed=1)
    offline = _offline(prompts, args.max_tokens)
    served, lasts = _cluster(prompts, args.max_tokens, args.backend)

    def med(values):
        return statistics.median(values)

    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens, one at a time")
    print(f"{'':22}{'TTFT ms':>10}{'TPOT ms':>10}")
    off_ttft, off_tpot = med([t for t, _ in offline]), med([p for _, p in offline])
    srv_ttft, srv_tpot = med([t for t, _ in served]), med([p for _, p in served])
    print(f"{'offline engine':22}{off_ttft:10.1f}{off_tpot:10.1f}")
    print(f"{'1P+1D cluster (' + args.backend + ')':22}{srv_ttft:10.1f}{srv_tpot:10.1f}")
    print(f"{'ratio cluster/offline':22}{srv_ttft / off_ttft:10.2f}{srv_tpot / off_tpot:10.2f}")
    prefill = med([x.timings["prefill_ms"] for x in lasts])
    transfer = med([x.timings["transfer_ms"] for x in lasts])
    print(f"cluster TTFT parts (median): prefill batch {prefill:.1f} ms, KV hand-off after prefill {transfer:.1f} ms, "
          f"backend {lasts[0].transfer_backend}")  # fmt: skip
