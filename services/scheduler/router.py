"""Places each new sequence on a ready worker: the one whose prefix cache holds
most of its prompt, then the least loaded one.

A prefix hit counts only when it covers at least MIN_HIT_FRACTION of the prompt
(a later turn of a conversation, a long shared system prompt), and only among
workers whose load is within `max_imbalance` sequences of the least loaded.
Every chat shares its template's first tokens: chasing such a small hit would
send all new conversations to the worker that cached it first, and none to a
worker that just (re)joined.

Prefill/decode disaggregation: where the ready workers include prefill and
decode ones, a request of one sequence (no beam search, no penalties or
grammar, whose worker state needs every token fed) goes to a prefill worker
and moves to a decode worker after its first token (handoff.py); any other
request runs on a decode (or both) worker, which computes its prompt itself.

The set of workers can change while serving (workers discovered through the
Kubernetes API, see discovery.py): engines are added and removed, and a
draining one keeps its running sequences but gets no new ones.
"""
from __future__ import annotations

import itertools

import grpc

from services.common.affinity import pick_bounded
from services.common.errors import NO_WORKER_READY, ServiceError
from services.scheduler.engine import EngineLoop
from services.scheduler.handoff import Handoff
from services.scheduler.sequence import Sequence

DEFAULT_MAX_IMBALANCE = 4
# As SGLang's cache-aware router (its cache_threshold): at least half the prompt.
MIN_HIT_FRACTION = 0.5


class Router:
    def __init__(self, engines: list[EngineLoop], max_imbalance: int = DEFAULT_MAX_IMBALANCE):
        self.engines: list[EngineLoop] = []
        self.max_imbalance = max_imbalance
        self._seq_ids = itertools.count(1)
        self._draining: set[int] = set()  # id() of draining engines
        self.handoff = Handoff(self.engines)
        for engine in engines:
            self.add(engine)

    def add(self, engine: EngineLoop) -> None:
        engine.admit = lambda info: self._refusal(engine, info)
        engine.on_prefilled = self.handoff.on_prefilled
        self.engines.append(engine)

    def remove(self, engine: EngineLoop) -> None:
        self.engines.remove(engine)
        self._draining.discard(id(engine))

    def set_draining(self, engine: EngineLoop, draining: bool) -> None:
        """A draining engine finishes what it runs and is given nothing new."""
        if draining:
            self._draining.add(id(engine))
        else:
            self._draining.discard(id(engine))

    def is_draining(self, engine: EngineLoop) -> bool:
        return id(engine) in self._draining

    def _refusal(self, engine: EngineLoop, info) -> str | None:
        """Why a worker may not join: it serves another model than the ready ones."""
        for other in self.engines:
            if other is not engine and other.is_ready and other.info is not None:
                if model_identity(other.info) != model_identity(info):
                    return (f"it serves {info.model_path} (vocabulary {info.vocab_size}), "
                            f"{other.worker.address} serves {other.info.model_path} "
                            f"(vocabulary {other.info.vocab_size})")
                return None
        return None

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def ready_engines(self) -> list[EngineLoop]:
        """Engines that take new sequences: ready, not draining by their own health
        (SIGTERM) nor by their endpoint (not ready or terminating)."""
        return [e for e in self.engines if e.accepts_sequences and id(e) not in self._draining]

    def holder(self, request_id: str, default: EngineLoop) -> EngineLoop:
        """The engine that delivers the request now (it may have moved since placed)."""
        return next((e for e in self.engines if e.delivers(request_id)), default)

    def place(self, seqs: list[Sequence]) -> EngineLoop:
        """The engine for a request's sequences; marks a leader that will move (`moves`)."""
        seq = seqs[0]
        ready = self.ready_engines
        if not ready:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, NO_WORKER_READY)
        if any(e.role != "both" for e in ready):
            prefill = [e for e in ready if e.role == "prefill"]
            movable = len(seqs) == 1 and seq.beam is None and not seq.sampling.needs_full_history
            if movable and prefill and any(e.role == "decode" for e in ready):
                ready, seq.moves = prefill, True
            else:
                ready = [e for e in ready if e.role != "prefill"] or ready

        def reusable(engine: EngineLoop) -> int:
            cached = engine.num_cached_prefix_tokens(seq)
            return cached if cached >= MIN_HIT_FRACTION * seq.num_prompt_tokens else 0

        return pick_bounded(ready, lambda e: e.load, reusable, self.max_imbalance)


def model_identity(info) -> tuple:
    """What must be equal for two workers to serve the same model (a worker's Describe answer)."""
    return info.model_path, info.vocab_size, tuple(sorted(info.eos_token_ids))
