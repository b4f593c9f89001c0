"""Reliability measurements on a local 2-prefill + 2-decode cluster (real processes, embedded Redis).

    python scripts/reliability.py soak     [--requests 2000 --concurrency 128]
    python scripts/reliability.py threads  [--requests 200 --concurrency 32]
    python scripts/reliability.py faults   [--requests 100 --concurrency 16 --max-tokens 32 --fault-after 5]

soak:    every request completes, greedy outputs of equal prompts are equal, and afterwards every decode
         worker's KV blocks are all free again and no lease is left in Redis.
threads: p99 latency with each worker given its share of the cores (``--threads``, what ``kvserve up`` does)
         against every worker using all cores (torch's default), both clusters up at once, alternating.
faults:  under a steady load, SIGKILL a decode worker, a prefill worker and Redis, and SIGSTOP Redis for 10 s;
         for each: requests lost, and seconds until the process serves again. Streams running on the killed
         decode worker move to the other (the router's stream migration); none should be lost.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster_state.registry import Registry  # noqa: E402
from kvserve.bench.loadgen import BenchRequest, LoadResult, run_load  # noqa: E402
from kvserve.launcher.cluster import Cluster, free_base_port, start_cluster  # noqa: E402
from kvserve.launcher.supervisor import RestartPolicy, Supervisor  # noqa: E402
from kvserve.settings import parse_up  # noqa: E402

ENGINE_ARGV = ["--model", "default", "--num-blocks", "512", "--block-size", "16"]
GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_TOKENS = 8


def prompts(n: int, distinct: int, seed: int = 0, max_tokens: int = MAX_TOKENS) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = [[rng.randrange(100, 20000) for _ in range(rng.randrange(16, 96))] for _ in range(distinct)]
    return [BenchRequest(pool[i % distinct], max_tokens) for i in range(n)]


async def closed_loop(target: str, requests: list[BenchRequest], concurrency: int) -> LoadResult:
    """``concurrency`` clients, each sending its next request as soon as its last one ended."""
    return await run_load(target, requests, max_concurrency=concurrency, sampling=GREEDY)


def up(log_dir: str, threads: int | None = None) -> Cluster:
    os.makedirs(log_dir, exist_ok=True)
    return start_cluster(parse_up([*ENGINE_ARGV, "--prefill", "2", "--decode", "2", "--port", str(free_base_port()),
                                   "--http-port", "0", "--log-dir", log_dir,
                                   *(["--threads", str(threads)] if threads else [])]))  # fmt: skip


def wait_idle(cluster: Cluster, timeout_s: float = 60.0) -> tuple[list, int]:
    """(decode workers' (id, free, total) once all blocks are free or the timeout passes, leases left)."""
    registry = Registry(cluster.redis_url, security=cluster.security)
    raw = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            decode = [(w.worker_id, w.free_blocks, w.total_blocks) for w in registry.workers("decode")]
            leases = len(raw.keys("kvserve:lease:*"))
            idle = all(free == total for _, free, total in decode) and not leases
            if idle or time.monotonic() > deadline:
                return decode, leases
            time.sleep(0.5)
    finally:
        registry.stop()
        raw.close()


def soak(args: argparse.Namespace, log_dir: str) -> int:
    cluster = up(log_dir)
    try:
        batch = prompts(args.requests, distinct=64)
        result = asyncio.run(closed_loop(cluster.endpoint, batch, args.concurrency))
        print(result.summary())
        by_prompt: dict[tuple, set] = {}
        for prompt, record in zip(batch, result.records, strict=True):
            if record.status == "OK":
                by_prompt.setdefault(tuple(prompt.prompt), set()).add(tuple(record.token_ids))
        differing = sum(len(outputs) > 1 for outputs in by_prompt.values())
        decode, leases = wait_idle(cluster)
        print(f"lost {len(result.records) - len(result.ok())}; prompts with differing outputs: {differing}")
        print(f"after the load: decode (id, free, total) {decode}; leases in Redis {leases}")
        clean = not result.errors and not differing and not leases and all(f == t for _, f, t in decode)
        return 0 if clean else 1
    finally:
        cluster.stop()


def threads(args: argparse.Namespace, log_dir: str) -> int:
    shared = up(os.path.join(log_dir, "share"))
    greedy = up(os.path.join(log_dir, "all"), threads=len(os.sched_getaffinity(0)))
    try:
        results: dict[str, list[LoadResult]] = {"share": [], "all cores": []}
        rounds = 4
        for i in range(rounds):  # alternate, so that drift hits both sides alike
            for name, cluster in (("share", shared), ("all cores", greedy)):
                batch = prompts(args.requests // rounds, distinct=32, seed=i)
                results[name].append(asyncio.run(closed_loop(cluster.endpoint, batch, args.concurrency)))
        p99 = {}
        for name, runs in results.items():
            merged = LoadResult([r for run in runs for r in run.records], sum(run.duration_s for run in runs))
            p99[name] = merged.percentile("e2e_s", 99)
            print(f"--- {name}\n{merged.summary()}")
        print(f"p99 end-to-end: share {p99['share'] * 1000:.0f} ms, all cores {p99['all cores'] * 1000:.0f} ms, "
              f"ratio {p99['all cores'] / p99['share']:.2f}x")  # fmt: skip
        return 0
    finally:
        shared.stop()
        greedy.stop()


def faults(args: argparse.Namespace, log_dir: str) -> int:
    cluster = up(log_dir)
    stop = threading.Event()
    supervisor = Supervisor(cluster.units(), RestartPolicy())
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    [redis_child] = [unit for unit in cluster.units() if unit.role == "redis"]
    try:
        rows = [_under_load(cluster, args, "SIGKILL decode-0", *_killed(cluster.child("decode-0")))]
        rows.append(_under_load(cluster, args, "SIGKILL prefill-0", *_killed(cluster.child("prefill-0"))))
        paused_until = []

        def pause() -> None:
            os.kill(redis_child.pid, signal.SIGSTOP)
            paused_until.append(time.monotonic() + 10)
            threading.Timer(10, os.kill, (redis_child.pid, signal.SIGCONT)).start()

        rows.append(_under_load(cluster, args, "SIGSTOP Redis 10 s", pause,
                                lambda: time.monotonic() > paused_until[0] and _registered(cluster)))  # fmt: skip
        old_redis = redis_child.pid
        rows.append(_under_load(cluster, args, "SIGKILL Redis", lambda: os.kill(old_redis, signal.SIGKILL),
                                lambda: redis_child.pid not in (None, old_redis) and redis_child.answers()
                                and _registered(cluster)))  # fmt: skip
        print("\n| fault | requests lost | of them before the first token | seconds to recovery |")
        print("|---|---|---|---|")
        for name, lost, total, before_first, recovery, errors in rows:
            print(f"| {name} | {lost}/{total} {errors or ''} | {before_first} | {recovery:.1f} |")
        return 0
    finally:
        stop.set()
        thread.join()
        cluster.stop()


def _under_load(cluster: Cluster, args: argparse.Namespace, name: str, inject, recovered) -> tuple:
    """Start the load, ``inject`` the fault ``args.fault_after`` seconds in, and wait until ``recovered()``:
    (name, requests lost, requests, lost before their first token, seconds to recovery, errors)."""
    requests = prompts(args.requests, 16, max_tokens=args.max_tokens)
    result: list[LoadResult] = []

    def run() -> None:
        result.append(asyncio.run(closed_loop(cluster.endpoint, requests, args.concurrency)))

    load = threading.Thread(target=run)
    load.start()
    time.sleep(args.fault_after)
    t0 = time.monotonic()
    inject()
    while not recovered():
        time.sleep(0.1)
    recovery = time.monotonic() - t0
    load.join()
    failed = [r for r in result[0].records if r.status != "OK"]
    before_first = sum(r.num_tokens == 0 for r in failed)  # the router must have retried all of these
    print(f"{name}: lost {len(failed)}/{len(result[0].records)} {dict(result[0].errors)} ({before_first} "
          f"before their first token); recovered in {recovery:.1f} s")  # fmt: skip
    time.sleep(3.0)
    return name, len(failed), len(result[0].records), before_first, recovery, dict(result[0].errors)


def _killed(child):  # noqa: ANN001, ANN202 - a cluster's child process
    """(inject, recovered) of SIGKILLing ``child``: recovered once a new process of it answers."""
    old = child.pid

    def inject() -> None:
        os.kill(old, signal.SIGKILL)

    return inject, lambda: child.pid not in (None, old) and child.answers()


def _registered(cluster: Cluster) -> bool:
    """Whether all four workers are registered in the cluster's Redis."""
    registry = Registry(cluster.redis_url, security=cluster.security)
    try:
        return len(registry.workers()) == 4
    finally:
        registry.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["soak", "threads", "faults"])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (faults: 32, else 8)")
    parser.add_argument("--fault-after", type=float, default=5.0, help="faults: seconds into the load")
    args = parser.parse_args()
    defaults = {"soak": (2000, 128), "threads": (200, 32), "faults": (100, 16)}[args.what]
    args.max_tokens = args.max_tokens or (32 if args.what == "faults" else MAX_TOKENS)
    args.requests = args.requests or defaults[0]
    args.concurrency = args.concurrency or defaults[1]
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="kvserve-reliability-") as log_dir:
        return {"soak": soak, "threads": threads, "faults": faults}[args.what](args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
