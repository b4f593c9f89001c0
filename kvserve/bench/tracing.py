"""What tracing costs: TPOT and TTFT through a 1P+1D cluster with tracing off against one tracing every request.

    kvserve bench tracing [--model default|DIR] [--rounds 8] [--prompt-len 128] [--max-tokens 32]

Two local clusters run side by side, one without ``--otlp-traces-endpoint``, one sending every request's
spans (``--trace-sample-ratio 1``) to an OTLP collector in this process (``kvserve.testing.otlp_receiver``). Each
round sends one greedy request (EOS ignored) to each cluster, the order alternating round by round (this
machine drifts); only one cluster works at a time. Reported: the median TPOT and TTFT of each side, their
ratios (target at sampling 1.0: TPOT <= 1.05x), and the spans the collector received.

Tracing off is the code path without tracing plus a handful of calls per request on ``NO_SPAN``: their cost is
timed here in a loop and printed against one TPOT (the target: <= 1.02x, that is within this machine's noise).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from kvserve.bench import report


def _no_span_cost_us(rounds: int = 100_000) -> float:
    """Microseconds per request of what tracing off still does: every span call a request makes, on ``NO_SPAN``."""
    from rpc import tracing

    start = time.perf_counter()
    for _ in range(rounds):
        span = tracing.start("kvserve.request", (), n=1)
        with span.child("router.validate") as child:
            child.set(prompt_tokens=1)
        span.child("router.decode_call").metadata()
        span.record("decode.queue", 0.0, 0.0)
        span.event("first_token", 0.0)
        span.end()
    return (time.perf_counter() - start) / rounds * 1e6


def main(argv: list[str] | None = None) -> int:
    from kvserve.client import Client
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up
    from kvserve.testing.otlp_receiver import OtlpReceiver

    parser = argparse.ArgumentParser(prog="kvserve bench tracing", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    receiver = OtlpReceiver()
    clusters = {}
    try:
        for side, extra in (("off", []), ("on", ["--otlp-traces-endpoint", receiver.endpoint])):
            port = free_base_port()
            up = parse_up(["--model", args.model, "--port", str(port), "--http-port", "0", "--num-blocks", "256",
                           "--log-dir", tempfile.mkdtemp(prefix=f"kvserve-bench-tracing-{side}-"), *extra])
            clusters[side] = start_cluster(up)
        rng = random.Random(0)
        samples: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for r in range(args.rounds + 1):  # round 0 warms both up, unmeasured
            prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
            for side in ("off", "on") if r % 2 else ("on", "off"):
                with Client(clusters[side].endpoint, timeout_s=300) as client:
                    result = client.generate(prompt, max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
                ttft, total = result.timings["ttft_ms"], result.timings["total_ms"]
                if r:
                    samples[side].append((ttft, (total - ttft) / (args.max_tokens - 1)))
        time.sleep(1.0)  # the last spans' batch
    finally:
        for c in clusters.values():
            c.stop()
        receiver.stop()
    rows = []
    for side in ("off", "on"):
        tpot = report.median(s[1] for s in samples[side])
        ttft = report.median(s[0] for s in samples[side])
        rows.append([side, round(tpot, 1), round(ttft, 1)])
    rows[1] += [round(rows[1][1] / rows[0][1], 3), round(rows[1][2] / rows[0][2], 3)]
    rows[0] += [1.0, 1.0]
    print(report.table(["tracing", "TPOT ms", "TTFT ms", "TPOT x off", "TTFT x off"], rows))
    traces = {s.trace_id for s in receiver.spans}
    print(f"spans received: {len(receiver.spans)} in {len(traces)} traces (tracing on: {args.rounds + 1} requests)")
    cost = _no_span_cost_us()
    print(f"tracing off: {cost:.2f} us of span calls per request = {1 + cost / 1e3 / rows[0][1]:.5f}x one TPOT")
    return 0
