"""``kvserve bench priority``: what a request's priority buys under overload, through a cluster.

    kvserve bench priority [--max-num-seqs 8] [--overload 2] [--high 12] [--prompt-len 128] [--max-tokens 32]

One decode worker behind the router (``kvserve up --prefill 0 --scheduling-policy priority --max-num-seqs N``).
Unloaded: ``--high`` requests at priority 0, one after another, each after a random pause (under
``PAUSE_S``, the same pauses on both sides). Loaded: ``overload x N`` users at priority 10,
each sending its next request as soon as the last ends (``overload`` times what the worker runs at once: the
rest wait in its queue), and meanwhile the same ``--high`` requests at priority 0, one after another. The two
sides alternate in two rounds (half the high-priority requests each), against this machine's drift. Reported:
the high-priority TTFT p50 and p99 unloaded and loaded and their ratio, and the low-priority requests that
finished with their longest end-to-end time (high-priority requests come one at a time, so a low one waits
for at most one of them at a time: none starves).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from kvserve.bench import report

PAUSE_S = 0.25  # the longest pause before each high-priority request


def _ttft(client, prompt: list[int], max_tokens: int, priority: int) -> float:
    began = time.perf_counter()
    first = None
    for _ in client.stream(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority):
        first = first or time.perf_counter() - began
    return first


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def run(endpoint: str, vocab: int, num_users: int, num_high: int, prompt_len: int, max_tokens: int,
        fill_s: float = 2.0, rounds: int = 2) -> dict:  # fmt: skip
    """The figures ``main`` prints, on the cluster at ``endpoint`` (``fill_s``: how long the users run before the
    first loaded high-priority request). The high-priority requests are split over ``rounds`` rounds, each
    unloaded then loaded: this machine's speed drifts over minutes, and both sides see each moment's."""
    from engine.heap import freeze_startup_heap
    from kvserve.client import Client

    freeze_startup_heap()  # (this process holds torch too: its own full collections would count as latency)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(prompt_len)]

    high_prompts = [prompt() for _ in range(num_high)]
    # each high-priority request after a pause of its own: one sent as the last ends would arrive just after a
    # step began (the last token ends a step), and wait for nearly all of it every time
    pauses = [rng.uniform(0, PAUSE_S) for _ in high_prompts]
    unloaded, loaded, low = [], [], []
    with Client(endpoint, timeout_s=600) as client:
        _ttft(client, prompt(), 2, 0)  # warm-up

        def highs(part: range, loaded_side: bool) -> list[float]:
            return [time.sleep(pauses[i]) or _ttft(client, [7, *high_prompts[i][1:]] if loaded_side
                                                   else high_prompts[i], max_tokens, 0)
                    for i in part]  # (the loaded side's prompts differ in their first token: not the cached prefix)

        for r in range(rounds):
            part = range(r * num_high // rounds, (r + 1) * num_high // rounds)
            unloaded += highs(part, False)
            stop = threading.Event()

            def user(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    began = time.perf_counter()
                    _ttft(client, prompt(), max_tokens, 10)
                    low.append(time.perf_counter() - began)

            users = [threading.Thread(target=user) for _ in range(num_users)]
            for thread in users:
                thread.start()
            time.sleep(fill_s)  # the queue fills
            loaded += highs(part, True)
            stop.set()
            for thread in users:
                thread.join()
    return {"unloaded p50 ms": statistics.median(unloaded) * 1e3, "unloaded p99 ms": percentile(unloaded, 99) * 1e3,
            "loaded p50 ms": statistics.median(loaded) * 1e3, "loaded p99 ms": percentile(loaded, 99) * 1e3,
            "p99 ratio": percentile(loaded, 99) / percentile(unloaded, 99), "low finished": len(low),
            "low longest s": max(low, default=0.0)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench priority", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--overload", type=float, default=2.0, help="low-priority users per running slot")
    parser.add_argument("--high", type=int, default=12, help="high-priority requests on each side")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the worker's step budget: a request that arrives waits for the step under way")
    parser.add_argument("--priority-chunk-tokens", type=int, default=None,
                        help="the worker's cap on a lower priority's prompt chunk after an urgent arrival (0: none)")
    args = parser.parse_args(argv)
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    vocab = ModelConfig.from_dir(resolve_model("default")).vocab_size
    base = free_base_port(4)
    cluster = start_cluster(parse_up(["--port", str(base), "--http-port", "0", "--prefill", "0", "--scheduling-policy",
                                      "priority", "--max-num-seqs", str(args.max_num_seqs),
                                      *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                                        if args.max_num_batched_tokens else []),
                                      *(["--priority-chunk-tokens", str(args.priority_chunk_tokens)]
                                        if args.priority_chunk_tokens is not None else [])]))  # fmt: skip
    try:
        row = run(cluster.endpoint, vocab, round(args.overload * args.max_num_seqs), args.high, args.prompt_len,
                  args.max_tokens)  # fmt: skip
    finally:
        cluster.stop()
    users = round(args.overload * args.max_num_seqs)
    print(f"priority: {args.high} high-priority requests, unloaded and beside {users} low-priority users "
          f"(max_num_seqs {args.max_num_seqs}), {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens")  # fmt: skip
    print(report.table(list(row), [[f"{v:.2f}" if isinstance(v, float) else v for v in row.values()]]))


if __name__ == "__main__":
    main()
