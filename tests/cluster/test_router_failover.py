"""Router replicas (``kvserve up --routers 2``) and the client's failover (``kvserve.failover``): 16 load
threads, half greedy and half seeded, each with a client given both routers; one router is SIGKILLed while
streams run through it. Every stream it carried is resumed through the other router as a continuation, and
nothing is lost: no request fails, and every answer is the offline engine's."""

from __future__ import annotations

import os
import signal

from cluster_utils import Load, cluster, discard, offline_answers, prometheus_values
from waiting import wait_until

CONCURRENCY, MAX_TOKENS = 16, 16


def _streamed(url: str) -> float:
    """Tokens the decode worker at ``url`` has streamed since it started (its inter-token latency count)."""
    return prometheus_values(url, "kvserve_inter_token_latency_seconds_bucket").get('le="+Inf"', 0.0)


def test_a_killed_router_loses_no_stream(tmp_path, llm):
    expected = offline_answers(llm, CONCURRENCY, MAX_TOKENS)
    c = cluster(1, 1, tmp_path, http=True, routers=2)
    load = None
    try:
        assert len(c.endpoints) == 2
        decode = c.child("decode-0").metrics_url
        load = Load(c.endpoints, threads=CONCURRENCY, max_tokens=MAX_TOKENS, expected=expected)
        start = _streamed(decode)
        wait_until(lambda: _streamed(decode) >= start + 2 * CONCURRENCY, 120, "the load streaming")
        # half the threads mid-way through a stream (each call starts on the next router: about half on this one)
        wait_until(lambda: load.mid_stream() >= CONCURRENCY // 2, 120, "streams mid-way", interval_s=0.01)
        os.kill(c.child("router").pid, signal.SIGKILL)  # mid-way through the streams it carries
        count = load.completed
        wait_until(lambda: load.done_since(count) >= 1, 120, "a request completed after the kill")
        load.stop()  # (each thread ends its request in flight: every stream the kill broke included)
        resumed = prometheus_values(c.child("router-1").metrics_url, "kvserve_router_resumed_streams_total")
    finally:
        if load is not None:
            load.stop()
        discard(c)
    print(f"\n{load.completed} requests completed, {len(load.failures)} failed, {len(load.wrong)} differ; "
          f"{resumed} streams resumed through router-1")  # fmt: skip
    assert load.failures == [] and load.wrong == []
    assert resumed[""] > 0  # the kill caught streams mid-way, and they went on through the other router
