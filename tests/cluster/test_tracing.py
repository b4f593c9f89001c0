"""Traces across processes (``rpc.tracing``): a 1P2D cluster under ``kvserve up --otlp-traces-endpoint`` sends its
spans to an OTLP collector in this test (a real gRPC ``TraceService``). One request is one trace, its spans from
the router, the decode worker and the prefill worker, each parented by the one that called it, under the client's
``traceparent``; a stream moved to another decode worker shows both workers in that trace. No span records a
prompt, an output or a token id."""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import urllib.request

import pytest
from cluster_utils import ENGINE_ARGV, cluster, discard, prometheus_values
from waiting import wait_until

from kvserve.client import Client
from kvserve.testing.otlp_receiver import OtlpReceiver, Received

PROMPT = "The history of the printing press in Europe begins with"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = OtlpReceiver()
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export every 0.2 s, not 5: the children inherit it
    try:
        c = cluster(1, 2, tmp_path_factory.mktemp("logs-tracing"), http=True,
                    decode_argv=["--drain-timeout", "1"],
                    engine_argv=[*ENGINE_ARGV, "--otlp-traces-endpoint", receiver.endpoint])  # fmt: skip
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    yield c, receiver
    discard(c)
    receiver.stop()


def _post(c, body: dict, traceparent: str | None) -> dict:
    headers = {"Content-Type": "application/json"} | ({"traceparent": traceparent} if traceparent else {})
    request = urllib.request.Request(f"{c.http_endpoint}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _spans(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> dict[str, list[Received]]:
    """The trace's spans by name, once every name in ``names`` has arrived."""
    wait_until(lambda: names <= {s.name for s in receiver.trace(trace_id)}, 30, f"spans {sorted(names)}")
    by_name: dict[str, list[Received]] = {}
    for span in receiver.trace(trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def test_one_request_is_one_trace_across_the_three_processes_parented_in_order(traced):
    c, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    reply = _post(c, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}, f"00-{trace_id}-{client_span}-01")
    spans = _spans(receiver, trace_id, {"kvserve.request", "router.validate", "router.route", "router.decode_call",
                                        "decode.generate", "decode.queue", "decode.remote_prefill", "decode.decode",
                                        "prefill.request", "prefill.queue", "prefill.compute", "prefill.handoff"})
    one = {name: found[0] for name, found in spans.items()}
    assert all(len(found) == 1 for found in spans.values()), {n: len(f) for n, f in spans.items()}

    def parent(name: str) -> str:
        return next(s.name for s in receiver.trace(trace_id) if s.span_id == one[name].parent_id)

    assert one["kvserve.request"].parent_id == client_span  # the client's span is the root's parent
    assert {n: parent(n) for n in one if n != "kvserve.request"} == {
        "router.validate": "kvserve.request", "router.route": "kvserve.request",
        "router.decode_call": "kvserve.request", "decode.generate": "router.decode_call",
        "decode.queue": "decode.generate", "decode.remote_prefill": "decode.generate",
        "decode.decode": "decode.generate", "prefill.request": "decode.remote_prefill",
        "prefill.queue": "prefill.request", "prefill.compute": "prefill.request", "prefill.handoff": "prefill.request",
    }  # fmt: skip
    services = {s.name.split(".")[0]: s.service for s in one.values()}
    assert services == {"kvserve": "kvserve-router", "router": "kvserve-router", "decode": "kvserve-decode",
                        "prefill": "kvserve-prefill"}  # fmt: skip
    route = one["router.route"].attributes
    assert sorted(c.split(":")[0] for c in route["kvserve.candidates"]) == ["decode-0", "decode-1", "prefill-0"]
    assert route["kvserve.prefill_worker"] == "prefill-0" and route["kvserve.reason"] in ("prefix", "load")
    assert one["decode.generate"].attributes["kvserve.worker"] == route["kvserve.decode_worker"]
    decoded = one["decode.decode"].attributes
    assert decoded["kvserve.completion_tokens"] == reply["usage"]["completion_tokens"] == 8
    assert "first_token" in one["decode.generate"].events
    handoff = one["prefill.handoff"].attributes
    assert handoff["kvserve.backend"] == "shm" and handoff["kvserve.bytes"] > 0
    assert one["decode.remote_prefill"].attributes["kvserve.bytes"] == handoff["kvserve.bytes"]
    # never the prompt, the answer or token ids
    texts = [str(v) for s in receiver.trace(trace_id) for v in s.attributes.values()]
    assert not any(word in text for text in texts for word in ("printing", reply["choices"][0]["text"].strip()))


def test_without_a_traceparent_or_with_a_malformed_one_the_router_starts_the_trace(traced):
    c, receiver = traced
    before = {s.trace_id for s in receiver.spans}
    for traceparent in (None, "00-not-a-trace-01", f"00-{'0' * 32}-{secrets.token_hex(8)}-01"):
        _post(c, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, traceparent)
    wait_until(lambda: len({s.trace_id for s in receiver.spans if s.name == "kvserve.request"} - before) == 3, 30,
               "three new traces")  # fmt: skip
    roots = [s for s in receiver.spans if s.name == "kvserve.request" and s.trace_id not in before]
    assert all(s.parent_id == "" for s in roots) and len({s.trace_id for s in roots}) == 3


@pytest.mark.soak  # about 25 s: on demand (pytest -m soak), outside make test's 15 minutes
def test_a_moved_stream_shows_both_decode_workers_in_its_trace(traced):
    c, receiver = traced
    trace_id = secrets.token_hex(16)
    done = []

    def stream() -> None:
        with Client(c.endpoint, timeout_s=120) as client:
            done.append(list(client.stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True,
                                           traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")))

    thread = threading.Thread(target=stream)
    thread.start()
    first = _spans(receiver, trace_id, {"router.route"})["router.route"][0].attributes["kvserve.decode_worker"]
    itl = "kvserve_inter_token_latency_seconds_bucket"
    wait_until(lambda: prometheus_values(c.child(first).metrics_url, itl).get('le="+Inf"', 0) > 8, 60, "tokens")
    os.kill(c.child(first).proc.pid, signal.SIGTERM)  # drains for 1 s, then hands the stream back
    thread.join(timeout=180)
    assert sum(len(chunk.token_ids) for chunk in done[0]) == 200
    wait_until(lambda: len(_spans(receiver, trace_id, {"kvserve.request"})["decode.generate"]) == 2, 30,
               "both decode workers' spans")  # fmt: skip
    spans = _spans(receiver, trace_id, set())
    workers = sorted(s.attributes["kvserve.worker"] for s in spans["decode.generate"])
    assert workers == ["decode-0", "decode-1"]
    moved = next(s for s in spans["decode.generate"] if s.attributes["kvserve.worker"] != first)
    assert moved.attributes["kvserve.resumed_tokens"] > 0
    assert any(s.error for s in spans["decode.generate"] if s.attributes["kvserve.worker"] == first)
    assert "migrated" in spans["kvserve.request"][0].events
