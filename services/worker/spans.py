"""The worker's trace spans (with tracing on, services/common/tracing.py).

A step runs many requests at once, so it is one `step` span with a link to
each sequence it ran, not a span per request per token. Each sequence is one
`sequence` span, child of its request's span in the scheduler (the
`traceparent` its first step carried): from its first step here to its release
(or the end of its step stream), which puts the worker in the request's trace.
A sequence preempted and admitted again gets a new one.
"""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Link

from services.common import tracing
from stormserve.worker.v1 import worker_pb2


class StepSpans:
    """Spans of one step stream; used on the event loop, after each step."""

    def __init__(self):
        self._sequences: dict[int, trace.Span] = {}

    def on_step(self, request: worker_pb2.StepRequest, started_ns: int, ended_ns: int, ok: bool) -> None:
        self.release(request.release_seq_ids, started_ns)
        links = []
        for s in request.sequences:
            span = self._sequences.get(s.seq_id)
            if span is None and s.traceparent:
                parent = tracing.span_context_of(s.traceparent)
                if parent is not None:
                    span = tracing.tracer.start_span(
                        "sequence", context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                        start_time=started_ns, attributes={"stormserve.seq_id": s.seq_id})
                    self._sequences[s.seq_id] = span
            if span is not None:
                links.append(Link(span.get_span_context()))
        for seq_id in request.decode_seq_ids:  # decodes by id: their span began with their first step
            if (span := self._sequences.get(seq_id)) is not None:
                links.append(Link(span.get_span_context()))
        num_decodes = len(request.decode_seq_ids)
        step = tracing.tracer.start_span(
            "step", start_time=started_ns, links=links,
            attributes={"stormserve.step_id": request.step_id,
                        "stormserve.step.num_sequences": len(request.sequences) + num_decodes,
                        "stormserve.step.num_tokens": num_decodes + sum(len(s.token_ids) or 1
                                                                        for s in request.sequences)})
        if not ok:
            step.set_status(trace.StatusCode.ERROR)
        step.end(end_time=ended_ns)

    def release(self, seq_ids, at_ns: int | None = None) -> None:
        for seq_id in seq_ids:
            span = self._sequences.pop(seq_id, None)
            if span is not None:
                span.end(end_time=at_ns)

    def close(self) -> None:
        self.release(list(self._sequences))
