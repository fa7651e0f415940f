"""OpenTelemetry traces, off unless the standard `OTEL_*` environment asks for them.

Tracing is on in a process when an OTLP endpoint is configured
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`) or
`OTEL_TRACES_EXPORTER=otlp`, and neither `OTEL_SDK_DISABLED=true` nor
`OTEL_TRACES_EXPORTER=none` says otherwise. Spans go out over OTLP/gRPC in
batches (`OTEL_BSP_*`); `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`
name the process (default service name `stormserve-<service>`).

Off, nothing here runs on a request's path: `enabled` is False, `inject`
returns nothing and callers skip their spans.

The W3C trace context (`traceparent`, `tracestate`) travels between the
services as gRPC metadata: in a per-request RPC's headers (Chat, Generate), or,
on a multiplexed stream (services/common/multiplex.py), in the `metadata` of
the message that starts the call, which the server side attaches as the
context its handler runs in. The worker gets a sequence's `traceparent` with
the step that first carries it.
"""
from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
enabled = False
tracer: trace.Tracer = trace.get_tracer("stormserve")


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (see the module doc)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if exporters == ["none"]:
        return False
    if exporters and exporters != ["otlp"]:
        raise SystemExit(f"OTEL_TRACES_EXPORTER: only otlp (or none) is supported, got {','.join(exporters)!r}")
    return bool(exporters or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on for this process when the environment asks for it."""
    global enabled, tracer
    if not configured(environ):
        return False
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol != "grpc":
        raise SystemExit(f"OTEL_EXPORTER_OTLP_PROTOCOL: only grpc is supported, got {protocol!r}")
    # The SDK is imported only here: a process without tracing never loads it.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME") or f"stormserve-{service}"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # what is still batched goes out at a clean exit
    tracer = trace.get_tracer("stormserve")
    enabled = True
    return True


def span(name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> AbstractContextManager[trace.Span | None]:
    """A span, current while the block runs, child of the current one; None when off."""
    return tracer.start_as_current_span(name, kind=kind) if enabled else nullcontext()


def inject() -> dict[str, str]:
    """The current context as W3C headers; empty when tracing is off."""
    carrier: dict[str, str] = {}
    if enabled:
        _propagator.inject(carrier)
    return carrier


def extract(metadata: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> otel_context.Context | None:
    """The context W3C headers (a mapping, or gRPC metadata pairs) carry; None when off."""
    if not enabled or not metadata:
        return None
    carrier = metadata if isinstance(metadata, Mapping) else {k: v for k, v in metadata if isinstance(v, str)}
    return _propagator.extract(carrier)


def traceparent(span: trace.Span) -> str:
    """The span as a `traceparent` header value (what the worker is sent)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def span_context_of(value: str) -> trace.SpanContext | None:
    """The span a `traceparent` header value names, or None for an invalid one."""
    ctx = trace.get_current_span(_propagator.extract({"traceparent": value})).get_span_context()
    return ctx if ctx.is_valid else None


def attach(ctx: otel_context.Context | None):
    """Make `ctx` current until `detach(token)`; a no-op for None."""
    return None if ctx is None else otel_context.attach(ctx)


def detach(token) -> None:
    if token is not None:
        otel_context.detach(token)


def trace_id_hex(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
