"""A test OTLP receiver: a gRPC server implementing the OTLP trace service
(opentelemetry.proto.collector.trace.v1.TraceService/Export) that keeps every
span it is sent, with the `service.name` of the process that sent it."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict:
        out = {}
        for kv in self.span.attributes:
            kind = kv.value.WhichOneof("value")
            value = getattr(kv.value, kind)
            if kind == "array_value":
                value = [getattr(v, v.WhichOneof("value")) for v in value.values]
            out[kv.key] = value
        return out


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the OTLP method name
        with self.receiver._lock:
            for resource_spans in request.resource_spans:
                service = next((kv.value.string_value for kv in resource_spans.resource.attributes
                                if kv.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    self.receiver.spans.extend(ReceivedSpan(service, s) for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, condition, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Poll until `condition(spans so far)` holds; returns the spans."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if condition(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
