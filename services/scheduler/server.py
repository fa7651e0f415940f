"""SchedulerService wiring: Generate streams a request's choices (one sequence per
sibling, or a beam search's results, see choices.py); cancelling the call aborts
every sibling. GenerateStream runs many such calls over one stream (the
tokenizer's), one message per engine step for all of them.

A call's messages are built in the engine's loop as each step is accounted
(`deliver`), straight into the stream's next message: the call's own task only
waits for the end. A task woken per token per step cost more than everything
else the scheduler does for a decode."""
from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace

from services.common import tracing
from services.common.drain import Drain
from services.common.errors import ServiceError
from services.common.multiplex import call_method, call_packed, call_reply, multiplexed_method
from services.scheduler import spans
from services.scheduler.choices import Choices
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import fill_response, to_sequences, to_worker_load
from services.scheduler.engine import EngineLoop, SequenceFailed, StreamItem, now_us
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.policy import CapacityError
from services.scheduler.router import Router
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, config: SchedulerConfig, router: Router, drain: Drain | None = None,
                 metrics: SchedulerMetrics | None = None):
        self.config = config
        self.router = router
        self.drain = drain or Drain("scheduler")  # refuses new Generate calls once SIGTERM came
        self._live: dict[str, tuple[EngineLoop, Choices]] = {}
        self._queue_full = metrics.rejected.labels("queue_full") if metrics is not None else None

    async def _generate(self, request):
        with tracing.span("generate", trace.SpanKind.SERVER) as span:
            await self._respond(request, span)

    async def _respond(self, request, span):
        started_us = now_us()
        if sum(e.load for e in self.router.engines) >= self.config.max_queue_size:
            if self._queue_full is not None:
                self._queue_full.inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request queue is full")
        if request.request_id in self._live:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} is already running")
        seqs, choices = to_sequences(request, self.router.next_seq_id, self.config, started_us)
        if span is not None:
            spans.carry(span, seqs)
        done = asyncio.get_running_loop().create_future()

        def deliver(items: list[StreamItem]) -> None:
            # In the engine's loop: each step's tokens go out from here, with no task switch.
            # Its middle tokens skip this: the engine gives them to the sequence's sink (pack).
            if done.done():
                return
            try:
                if items and isinstance(failure := items[0], SequenceFailed):
                    done.set_exception(ServiceError(failure.code, failure.message))
                    return
                for update in choices.accept(items):
                    fill_response(reply(scheduler_pb2.GenerateResponse), update, choices)
                if choices.is_done:
                    done.set_result(None)
                elif pack is not None and (seq := choices.packable()) is not None:
                    seq.sink = pack
            except Exception as exc:  # noqa: BLE001 - a fault of this request ends it alone
                log.exception("%s: delivering its tokens failed", request.request_id)
                done.set_exception(exc)
                for seq in choices.seqs:  # nothing more goes out before the call ends
                    seq.sink = None

        # Siblings share the prompt's KV blocks, so they all run on one worker.
        engine = self.router.place(seqs)
        reply, pack = call_reply(), call_packed()
        try:
            engine.submit(seqs, deliver)
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from exc
        self._live[request.request_id] = (engine, choices)
        failed = False
        try:
            await done
        except ServiceError:
            failed = True
            raise
        finally:
            self._live.pop(request.request_id, None)
            for seq in choices.seqs:
                seq.sink = None
            engine = self.router.holder(request.request_id, engine)  # it may have moved (handoff.py)
            if choices.unfinished:
                engine.abort(choices.unfinished)
            engine.detach(request.request_id)
            finished_us = now_us()
            if engine.metrics is not None:
                for seq in choices.seqs:
                    reason = "error" if failed else seq.finish_reason.value if seq.finish_reason else "abort"
                    engine.metrics.on_finished(seq, reason, finished_us)
            if span is not None:
                spans.end_request(span, started_us, self.config.model_name, choices.seqs,
                                  request.n if request.HasField("n") else 1, failed, finished_us)

    Generate = call_method(_generate)
    GenerateStream = multiplexed_method(_generate, scheduler_pb2.GenerateStreamResponse,
                                        scheduler_pb2.GenerateStreamEvent, packed="tokens")

    async def Abort(self, request, context):
        entry = self._live.get(request.request_id)
        if entry is None:
            return scheduler_pb2.AbortResponse(found=False)
        engine, choices = entry
        engine = self.router.holder(request.request_id, engine)
        seqs = choices.unfinished
        if request.HasField("index"):
            seqs = [s for s in seqs if s.index == choices.sibling_of(request.index)]
        engine.abort(seqs)
        return scheduler_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        engines = self.router.engines
        return scheduler_pb2.GetLoadResponse(
            num_waiting=sum(e.policy.num_unfinished - len(e.policy.running) for e in engines if e.policy),
            num_running=sum(len(e.policy.running) for e in engines if e.policy),
            num_workers_ready=len(self.router.ready_engines),
            num_steps=sum(e.num_steps for e in engines),
            workers=[to_worker_load(e, self.router.is_draining(e)) for e in engines],
        )
