"""Places each new sequence on a ready worker: the one whose prefix cache holds
most of its prompt, then the least loaded one.

A prefix hit only counts among workers whose load is within `max_imbalance`
sequences of the least loaded: every chat shares its template's first tokens,
and chasing that small hit alone would pile all traffic on one worker.
"""
from __future__ import annotations

import itertools

import grpc

from services.common.errors import ServiceError
from services.scheduler.engine import EngineLoop
from services.scheduler.sequence import Sequence

DEFAULT_MAX_IMBALANCE = 4


class Router:
    def __init__(self, engines: list[EngineLoop], max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        self.engines = engines
        self.max_imbalance = max_imbalance
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
        lowest = min(e.load for e in ready)
        candidates = [e for e in ready if e.load <= lowest + self.max_imbalance]
        # min() keeps the first of equals: configuration order breaks ties.
        return min(candidates, key=lambda e: (-e.num_cached_prefix_tokens(seq), e.load))
