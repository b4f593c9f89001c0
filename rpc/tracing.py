"""OpenTelemetry traces: one request's path across the router, the decode worker, the prefill worker and the KV
hand-off, as one trace.

Off by default. With ``--otlp-traces-endpoint`` (every process, and ``kvserve up``, which passes it on) a process
sends its spans over OTLP/gRPC to that collector, batched on a thread of OpenTelemetry's (``BatchSpanProcessor``):
a request never waits for an export. Spans a collector did not take (unreachable, refusing) are dropped and
counted in ``kvserve_trace_spans_dropped_total``. Off, nothing of OpenTelemetry is imported and every call here
is a method of ``NO_SPAN``, which does nothing.

Context: a client's W3C ``traceparent`` (an HTTP header, or gRPC metadata) is the parent of the router's
``kvserve.request`` span; a malformed one, or none, starts a new trace. Each internal call carries its caller's
span as ``traceparent`` metadata (``Span.metadata``): router -> decode worker -> prefill worker. Sampling follows
the parent's decision, and without one keeps ``--otlp-traces-sample-ratio`` of the requests (by trace id, so
every process agrees).

What a span records is counts, times, names and decisions: never a prompt, an output or a token id. Spans whose
times the engine loop already keeps (queueing, waiting for KV, decoding) are recorded when the request ends, from
those times (``Span.record``), so the loop does nothing per step for tracing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rpc import metrics
from rpc.options import TracingSettings

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_tracer: Any = None  # OpenTelemetry's, once ``setup`` saw an endpoint
_provider: Any = None


def setup(service: str, instance: str, settings: TracingSettings) -> None:
    """Start exporting this process's spans (``service``: its role, ``instance``: its name) when ``settings``
    name an endpoint; otherwise do nothing."""
    global _tracer, _provider
    if not settings.otlp_traces_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class CountingExporter(SpanExporter):
        """OTLP's exporter, counting the spans it could not deliver."""

        def __init__(self, inner: SpanExporter) -> None:
            self.inner = inner

        def export(self, spans):
            result = self.inner.export(spans)
            if result != SpanExportResult.SUCCESS:
                metrics.TRACE_SPANS_DROPPED.inc(len(spans))
            return result

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return self.inner.force_flush(timeout_millis)

    endpoint = settings.otlp_traces_endpoint
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=5)
    resource = Resource.create({"service.name": f"kvserve-{service}", "service.instance.id": instance})
    _provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)))
    _provider.add_span_processor(BatchSpanProcessor(CountingExporter(exporter)))
    _tracer = _provider.get_tracer("kvserve")
    log.info("tracing: spans of %s go to %s (sampling %.0f%% of new traces)", instance, endpoint,
             settings.trace_sample_ratio * 100)  # fmt: skip


def shutdown() -> None:
    """Send what is still batched (at most a few seconds), then stop; a process calls it on its way out."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


class Span:
    """A live span, or ``NO_SPAN`` (tracing off), whose every method does nothing. Ending it twice is harmless."""

    __slots__ = ("_span",)

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def __bool__(self) -> bool:
        return self._span is not None

    def child(self, name: str, start: float | None = None, /, **attributes: Any) -> Span:
        """A child span starting now, or at ``start`` (a ``time.perf_counter`` instant)."""
        if self._span is None:
            return NO_SPAN
        from opentelemetry import trace

        return Span(_tracer.start_span(name, trace.set_span_in_context(self._span), attributes=_clean(attributes),
                                       start_time=None if start is None else wall_ns(start)))  # fmt: skip

    def record(self, name: str, start: float, end: float, /, **attributes: Any) -> None:
        """A finished child span, from ``time.perf_counter`` instants."""
        if self._span is not None:
            self.child(name, start, **attributes)._span.end(end_time=wall_ns(max(start, end)))

    def set(self, **attributes: Any) -> None:
        if self._span is not None:
            self._span.set_attributes(_clean(attributes))

    def event(self, name: str, at: float | None = None, /, **attributes: Any) -> None:
        """An event now, or at ``at`` (a ``time.perf_counter`` instant)."""
        if self._span is not None:
            self._span.add_event(name, _clean(attributes), None if at is None else wall_ns(at))

    def end(self, error: str | None = None) -> None:
        """End the span now; ``error``: why the work it covers failed (its status)."""
        if self._span is None or not self._span.is_recording():
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error[:256]))
        self._span.end()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that makes this span the parent of the callee's: ``traceparent``, or nothing."""
        if self._span is None:
            return ()
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(self._span))
        return tuple(carrier.items())

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind, error, _tb) -> None:
        self.end(None if error is None else kind.__name__)  # (not its message: it may quote the request)


NO_SPAN = Span()


def start(name: str, carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None = None, /,
          **attributes: Any) -> Span:
    """A span starting now whose parent is the one a caller sent in ``carrier`` (gRPC metadata, HTTP headers:
    its ``traceparent``); none there, or a malformed one: a new trace. ``NO_SPAN`` with tracing off."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers = {k.lower(): v for k, v in (carrier.items() if isinstance(carrier, Mapping) else carrier or ())
               if isinstance(v, str)}  # fmt: skip
    context = TraceContextTextMapPropagator().extract({TRACEPARENT: headers[TRACEPARENT]}) \
        if TRACEPARENT in headers else None  # fmt: skip
    return Span(_tracer.start_span(name, context, attributes=_clean(attributes)))


def wall_ns(instant: float) -> int:
    """A ``time.perf_counter`` instant as Unix time in nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - instant) * 1e9)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes under ``kvserve.`` (names without a dot get it), None values left out."""
    return {(k if "." in k else f"kvserve.{k}"): v for k, v in attributes.items() if v is not None}
