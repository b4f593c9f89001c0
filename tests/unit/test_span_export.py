"""``rpc.tracing`` in one process: off, every call does nothing and nothing propagates; on, a collector that
cannot be reached costs the request nothing but its spans, which are dropped and counted."""

from __future__ import annotations

import socket

from prometheus_client import REGISTRY

from rpc import tracing
from rpc.options import TracingSettings


def test_off_every_span_is_no_span_and_nothing_propagates():
    span = tracing.start("kvserve.request", {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}, n=1)
    assert span is tracing.NO_SPAN and not span
    with span.child("router.route", None, reason="load") as child:
        child.record("decode.queue", 0.0, 1.0)
        child.event("first_token")
    assert span.metadata() == ()


def test_an_unreachable_collector_drops_the_spans_and_counts_them():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    before = REGISTRY.get_sample_value("kvserve_trace_spans_dropped_total") or 0
    tracing.setup("router", "router", TracingSettings(otlp_traces_endpoint=f"http://127.0.0.1:{port}"))
    try:
        span = tracing.start("kvserve.request", {"traceparent": "00-malformed-01"})
        assert span and dict(span.metadata())["traceparent"].startswith("00-")  # a new trace, propagated
        span.child("router.validate").end()
        span.end()
        tracing._provider.force_flush()  # the export fails (after the exporter's retries)
    finally:
        tracing.shutdown()
    assert (REGISTRY.get_sample_value("kvserve_trace_spans_dropped_total") or 0) - before == 2
    assert tracing.start("kvserve.request") is tracing.NO_SPAN  # off again
