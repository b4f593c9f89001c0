"""Prefix caching through a local cluster (real processes, embedded Redis), ratios from one run.

    python scripts/prefix_cache.py ttft       # 2,000-token prompts whose first 1,800 tokens are cached vs cold
    python scripts/prefix_cache.py workload   # 4 system prompts of ~1,000 tokens x 8 questions, 2P+2D,
                                              # prefix caching on against off, both clusters up at once
    python scripts/prefix_cache.py inplace    # the prefill worker reads the decode worker's cached prefix
                                              # in place, against recomputing it; both clusters up at once

ttft:     1P+1D; each round a new 1,800-token prefix: its first request is cold, a second with the same prefix
          and another 200-token tail is warm. Reports both TTFTs, their ratio and the cached token counts.
workload: the shared-system-prompt workload, alternating halves between the two clusters: prompt tokens
          computed, hit rate, TTFT p50/p99, throughput and how many requests each decode worker served.
inplace:  two 1P+1D clusters over shm whose prefill workers cache nothing; the decode workers differ only in
          --prefill-reads-cached-prefix (true: read in place, false: recompute). Each round a new 1,800-token
          prefix goes to both (the decode workers cache it), then a 2,000-token prompt sharing it, in
          alternating order. Reports both TTFTs, their ratio and the prefill workers' token counts by source.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from kvserve.bench.datasets import shared_prefix_requests  # noqa: E402
from kvserve.bench.loadgen import LoadResult, run_load  # noqa: E402
from kvserve.client import Client  # noqa: E402
from kvserve.launcher.cluster import Cluster, free_base_port, start_cluster  # noqa: E402
from kvserve.launcher.plan import ExtraArgv  # noqa: E402
from kvserve.launcher.processes import Child  # noqa: E402
from kvserve.settings import parse_up  # noqa: E402

VOCAB = 49152
GREEDY = {"temperature": 0, "ignore_eos": True}


def up(log_dir: str, num_prefill: int, num_decode: int, caching: bool, decode_argv: list[str] | None = None,
       prefill_argv: list[str] | None = None) -> Cluster:  # fmt: skip
    os.makedirs(log_dir, exist_ok=True)
    engine = ["--model", "default", "--num-blocks", "1024", "--block-size", "16", "--enable-prefix-caching",
              str(caching).lower()]  # fmt: skip
    up = parse_up([*engine, "--prefill", str(num_prefill), "--decode", str(num_decode), "--port", str(free_base_port()),
                   "--http-port", "0", "--log-dir", log_dir])  # fmt: skip
    return start_cluster(up, ExtraArgv(decode=tuple(decode_argv or ()), prefill=tuple(prefill_argv or ())))


def ttft(log_dir: str, rounds: int) -> None:
    cluster = up(log_dir, 1, 1, caching=True)
    rng = random.Random(0)
    cold, warm = [], []
    try:
        with Client(cluster.endpoint, timeout_s=300) as client:
            for i in range(rounds):
                prefix = [rng.randrange(100, VOCAB) for _ in range(1800)]
                results = [client.generate(prefix + [rng.randrange(100, VOCAB) for _ in range(200)], max_tokens=1,
                                           **GREEDY) for _ in range(2)]  # fmt: skip
                (c, w) = (r.timings["ttft_ms"] for r in results)
                cold.append(c)
                warm.append(w)
                print(f"round {i}: cold {c:.0f} ms (cached {results[0].usage['cached_prompt_tokens']}), "
                      f"warm {w:.0f} ms (cached {results[1].usage['cached_prompt_tokens']}), ratio {w / c:.2f}")
    finally:
        cluster.stop()
    print(f"median TTFT: cold {statistics.median(cold):.0f} ms, warm {statistics.median(warm):.0f} ms, "
          f"warm/cold {statistics.median(warm) / statistics.median(cold):.2f} (target <= 0.25)")


def metric_sum(children: list[Child], line_prefix: str) -> float:
    """The sum over ``children``'s ``/metrics`` of the samples whose line starts with ``line_prefix``."""
    total = 0.0
    for child in children:
        text = urllib.request.urlopen(child.metrics_url, timeout=10).read().decode()
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix))
    return total


def served_per_decode_worker(cluster: Cluster) -> dict[str, float]:
    return {child.name: metric_sum([child], 'kvserve_requests_total{outcome="finished"')
            for child in cluster.children if child.role == "decode"}  # fmt: skip


def inplace(log_dir: str, rounds: int) -> None:
    sides = {"read": "true", "recompute": "false"}  # name -> the decode worker's --prefill-reads-cached-prefix
    rng = random.Random(0)
    ttfts: dict[str, list[float]] = {name: [] for name in sides}
    with ExitStack() as stack:  # clients close first, then the clusters stop, also when one fails to start
        clusters: dict[str, Cluster] = {}
        for name, flag in sides.items():
            clusters[name] = up(os.path.join(log_dir, name), 1, 1, True, ["--prefill-reads-cached-prefix", flag],
                                ["--enable-prefix-caching", "false"])  # fmt: skip
            stack.callback(clusters[name].stop)
        clients = {name: stack.enter_context(Client(c.endpoint, timeout_s=300)) for name, c in clusters.items()}
        for i in range(rounds):
            prefix = [rng.randrange(100, VOCAB) for _ in range(1800)]
            warm, prompt = ([*prefix, *(rng.randrange(100, VOCAB) for _ in range(200))] for _ in range(2))
            cached = {}
            for name in list(sides) if i % 2 == 0 else list(reversed(sides)):  # alternate: drift hits both alike
                clients[name].generate(warm, max_tokens=1, **GREEDY)  # the decode worker now caches the prefix
                result = clients[name].generate(prompt, max_tokens=1, **GREEDY)
                ttfts[name].append(result.timings["ttft_ms"])
                cached[name] = result.usage["cached_prompt_tokens"]
            r, c = ttfts["read"][-1], ttfts["recompute"][-1]
            print(f"round {i}: read in place {r:.0f} ms, recompute {c:.0f} ms (decode worker cached {cached}), "
                  f"ratio {r / c:.2f}")
        for name, cluster in clusters.items():
            prefills = [child for child in cluster.children if child.role == "prefill"]
            by_source = {source: metric_sum(prefills, f'kvserve_prefill_prompt_tokens_total{{source="{source}"')
                         for source in ("computed", "own_cache", "destination")}  # fmt: skip
            print(f"{name}: the prefill worker's prompt tokens by source {by_source}")
    r, c = statistics.median(ttfts["read"]), statistics.median(ttfts["recompute"])
    print(f"median TTFT of a 2,000-token prompt whose first 1,792 tokens the decode worker holds: read in place "
          f"{r:.0f} ms, recompute {c:.0f} ms, read/recompute {r / c:.2f}")


def workload(log_dir: str, concurrency: int) -> None:
    requests = shared_prefix_requests(4, 8, prefix_len=1000, input_len=40, output_len=16, vocab_size=VOCAB)
    halves = [requests[: len(requests) // 2], requests[len(requests) // 2 :]]
    clusters = {"on": up(os.path.join(log_dir, "on"), 2, 2, True), "off": up(os.path.join(log_dir, "off"), 2, 2, False)}
    try:
        runs: dict[str, list[LoadResult]] = {"on": [], "off": []}
        for half in halves:  # alternate, so that drift hits both sides alike
            for name, cluster in clusters.items():
                runs[name].append(asyncio.run(run_load(cluster.endpoint, list(half), max_concurrency=concurrency,
                                                       sampling=GREEDY)))  # fmt: skip
        for name, results in runs.items():
            merged = LoadResult([r for run in results for r in run.records], sum(run.duration_s for run in results))
            ok = merged.ok()
            prompt = sum(r.num_prompt_tokens for r in ok)
            cached = sum(r.num_cached_tokens for r in ok)
            print(f"--- prefix caching {name}\n{merged.summary()}")
            print(f"prompt tokens {prompt}, computed {prompt - cached}, hit rate {cached / max(1, prompt):.1%}; "
                  f"requests served per decode worker {served_per_decode_worker(clusters[name])}")
    finally:
        for cluster in clusters.values():
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["ttft", "workload", "inplace"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvserve-prefix-") as log_dir:
        if args.what == "ttft":
            ttft(log_dir, args.rounds)
        elif args.what == "inplace":
            inplace(log_dir, args.rounds)
        else:
            workload(log_dir, args.concurrency)


if __name__ == "__main__":
    main()
