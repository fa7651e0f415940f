"""Places each new sequence on a ready worker (the least loaded one)."""
from __future__ import annotations

import itertools

from services.common.errors import ServiceError
from services.scheduler.engine import EngineLoop
from services.scheduler.sequence import Sequence

import grpc


class Router:
    def __init__(self, engines: list[EngineLoop]):
        self.engines = engines
        self._seq_ids = itertools.count(1)

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def ready_engines(self) -> list[EngineLoop]:
        return [e for e in self.engines if e.is_ready]

    def place(self, seq: Sequence) -> EngineLoop:
        ready = self.ready_engines
        if not ready:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        return min(ready, key=lambda e: e.load)
