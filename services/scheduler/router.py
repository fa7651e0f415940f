"""Places each new sequence on a ready worker: the one whose prefix cache holds
most of its prompt, then the least loaded one.

A prefix hit counts only when it covers at least MIN_HIT_FRACTION of the prompt
(a later turn of a conversation, a long shared system prompt), and only among
workers whose load is within `max_imbalance` sequences of the least loaded.
Every chat shares its template's first tokens: chasing such a small hit would
send all new conversations to the worker that cached it first, and none to a
worker that just (re)joined.
"""
from __future__ import annotations

import itertools

import grpc

from services.common.errors import ServiceError
from services.scheduler.engine import EngineLoop
from services.scheduler.sequence import Sequence

DEFAULT_MAX_IMBALANCE = 4
# As SGLang's cache-aware router (its cache_threshold): at least half the prompt.
MIN_HIT_FRACTION = 0.5


class Router:
    def __init__(self, engines: list[EngineLoop], max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        self.engines = engines
        self.max_imbalance = max_imbalance
        self._seq_ids = itertools.count(1)

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def ready_engines(self) -> list[EngineLoop]:
        """Those that take new sequences: ready, and not draining."""
        return [e for e in self.engines if e.accepts_sequences]

    def place(self, seq: Sequence) -> EngineLoop:
        ready = self.ready_engines
        if not ready:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        lowest = min(e.load for e in ready)
        candidates = [e for e in ready if e.load <= lowest + self.max_imbalance]

        def reusable(engine: EngineLoop) -> int:
            cached = engine.num_cached_prefix_tokens(seq)
            return cached if cached >= MIN_HIT_FRACTION * seq.num_prompt_tokens else 0

        # min() keeps the first of equals: configuration order breaks ties.
        return min(candidates, key=lambda e: (-reusable(e), e.load))
