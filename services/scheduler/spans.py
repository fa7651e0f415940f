"""The scheduler's trace spans (with tracing on, services/common/tracing.py).

Each Generate call is one `generate` span, child of the tokenizer's, with the
request's `gen_ai.*` attributes (OpenTelemetry's GenAI conventions, and vLLM's
`gen_ai.latency.*` and `gen_ai.request.n` where those have no name). Its
sequences' phases become child spans once the call is done, from the times the
metrics keep anyway: `queue` (arrival to first admitted to a batch), `prefill`
(to the first token) and `decode` (to the last) — nothing is traced per step
or per token here. The worker's spans for a sequence are children of the
`generate` span, whose `traceparent` the sequence carries to the worker.
"""
from __future__ import annotations

from opentelemetry import trace

from services.common import tracing
from services.scheduler.sequence import Sequence

US_TO_NS = 1000


def carry(span: trace.Span, seqs: list[Sequence]) -> None:
    """Give the sequences that will run (beams too) the span's traceparent."""
    value = tracing.traceparent(span)
    for seq in seqs:
        seq.traceparent = value
        if seq.beam is not None:
            for beam in seq.beam.beams:
                beam.traceparent = value


def end_request(span: trace.Span, started_us: int, model: str, seqs: list[Sequence], n: int, failed: bool,
                now_us: int) -> None:
    """Attributes and phase spans of a call that began at `started_us` and is
    done now (finished, failed or cancelled)."""
    first = seqs[0]
    reasons = ["error" if failed else s.finish_reason.value if s.finish_reason else "abort" for s in seqs]
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": first.stopping.max_tokens,
        "gen_ai.request.temperature": first.sampling.temperature,
        "gen_ai.request.top_p": first.sampling.top_p,
        "gen_ai.request.n": n,
        "gen_ai.response.id": first.request_id,
        "gen_ai.response.finish_reasons": reasons,
        "gen_ai.usage.input_tokens": first.num_prompt_tokens,
        "gen_ai.usage.output_tokens": sum(len(s.output_token_ids) for s in seqs),
        "gen_ai.latency.e2e": (now_us - first.arrival_us) / 1e6,
    }
    first_tokens = [s.first_token_us for s in seqs if s.first_token_us]
    if first_tokens:
        attributes["gen_ai.latency.time_to_first_token"] = (min(first_tokens) - first.arrival_us) / 1e6
    scheduled = [s.first_scheduled_us for s in seqs if s.first_scheduled_us]
    if scheduled:
        attributes["gen_ai.latency.time_in_queue"] = (min(scheduled) - first.arrival_us) / 1e6
    span.set_attributes(attributes)
    if failed:
        span.set_status(trace.StatusCode.ERROR)
    parent = trace.set_span_in_context(span)
    for seq in seqs:
        phases = [("queue", max(seq.arrival_us, started_us), seq.first_scheduled_us or now_us)]
        if seq.first_scheduled_us:
            phases.append(("prefill", seq.first_scheduled_us, seq.first_token_us or now_us))
        if seq.first_token_us:
            phases.append(("decode", seq.first_token_us, seq.last_event_us))
        for name, start_us, end_us in phases:
            phase = tracing.tracer.start_span(name, context=parent, start_time=start_us * US_TO_NS,
                                              attributes={"stormserve.choice_index": seq.index})
            phase.end(end_time=max(start_us, end_us) * US_TO_NS)
