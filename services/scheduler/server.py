"""SchedulerService wiring: Generate streams a sequence's tokens; cancelling the
call aborts the sequence."""
from __future__ import annotations

import logging

import grpc

from services.common.errors import ServiceError
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_response, to_sequence, to_worker_load
from services.scheduler.engine import SequenceFailed, now_us
from services.scheduler.policy import CapacityError
from services.scheduler.router import Router
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, config: SchedulerConfig, router: Router):
        self.config = config
        self.router = router
        self._live: dict[str, tuple] = {}  # request_id -> (engine, seq)

    async def Generate(self, request, context):
        if sum(e.load for e in self.router.engines) >= self.config.max_queue_size:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request queue is full")
        if request.request_id in self._live:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} is already running")
        seq = to_sequence(request, self.router.next_seq_id(), self.config, now_us())
        engine = self.router.place(seq)
        try:
            stream = engine.submit(seq)
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from exc
        self._live[seq.request_id] = (engine, seq)
        is_first = True
        try:
            while True:
                # Coalesce whatever is pending into one message when the reader is behind.
                items = [await stream.get()]
                while not stream.empty():
                    items.append(stream.get_nowait())
                failure = next((i for i in items if isinstance(i, SequenceFailed)), None)
                if failure is not None:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, failure.message)
                yield to_response(seq, items, is_first)
                is_first = False
                if seq.is_finished:
                    return
        finally:
            self._live.pop(seq.request_id, None)
            if not seq.is_finished:
                engine.abort(seq)

    async def Abort(self, request, context):
        entry = self._live.get(request.request_id)
        if entry is None:
            return scheduler_pb2.AbortResponse(found=False)
        engine, seq = entry
        engine.abort(seq)
        return scheduler_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        engines = self.router.engines
        return scheduler_pb2.GetLoadResponse(
            num_waiting=sum(len(e.policy.waiting) for e in engines if e.policy),
            num_running=sum(len(e.policy.running) for e in engines if e.policy),
            num_workers_ready=len(self.router.ready_engines),
            num_steps=sum(e.num_steps for e in engines),
            workers=[to_worker_load(e) for e in engines],
        )
