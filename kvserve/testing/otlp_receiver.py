"""An OTLP trace collector for tests and benchmarks: a real gRPC ``TraceService`` server (OpenTelemetry's protos)
that keeps every span it is sent, as ``Received`` records, so a test can read back what the processes
exported (tests/cluster/test_tracing.py) and ``kvserve bench tracing`` can count them."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc


@dataclass(frozen=True)
class Received:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, object]
    events: tuple[str, ...]
    error: bool


class OtlpReceiver(otlp_grpc.TraceServiceServicer):
    """Listens on 127.0.0.1 (``endpoint``) until ``stop``."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        otlp_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def Export(self, request: otlp.ExportTraceServiceRequest, context) -> otlp.ExportTraceServiceResponse:
        got = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")  # fmt: skip
            for scope in resource_spans.scope_spans:
                got += [Received(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                 {a.key: _value(a.value) for a in s.attributes}, tuple(e.name for e in s.events),
                                 s.status.code == 2) for s in scope.spans]  # fmt: skip
        with self._lock:
            self.spans += got
        return otlp.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self._server.stop(grace=None)


def _value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
