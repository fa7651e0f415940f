"""Continuous batching for one worker: which sequences run in the next step.

Every step decodes all running sequences and admits waiting ones first come,
first served while the batch limit, the prefill-token budget and the worker's
KV capacity allow. Requests join between steps and leave when they finish, so
a long request never keeps a short one from starting.

KV capacity is reserved for a sequence's whole life (prompt + max output) on
admission, so a running sequence can never run out of cache mid-generation.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.sequence import (
    FinishReason,
    Sequence,
    SequenceStatus,
    TokenEvent,
)


@dataclass(frozen=True)
class WorkerCapacity:
    """What the worker reported in Describe."""

    num_kv_blocks: int
    block_size: int
    max_batch_size: int
    eos_token_ids: frozenset[int]


@dataclass
class StepPlan:
    step_id: int
    sequences: list[Sequence]
    release_seq_ids: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.sequences)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class CapacityError(ValueError):
    """The request can never fit this worker, whatever else is running."""


class BatchPolicy:
    def __init__(self, capacity: WorkerCapacity, max_batch_size: int, max_prefill_tokens: int):
        self.capacity = capacity
        self.max_batch_size = min(max_batch_size, capacity.max_batch_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._num_reserved_blocks = 0
        self._to_release: list[int] = []
        self._next_step_id = 0

    # -- admission ---------------------------------------------------------
    def blocks_needed(self, seq: Sequence) -> int:
        return math.ceil((seq.num_prompt_tokens + seq.stopping.max_tokens) / self.capacity.block_size)

    def add(self, seq: Sequence) -> None:
        if self.blocks_needed(seq) > self.capacity.num_kv_blocks:
            raise CapacityError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.stopping.max_tokens}) "
                f"exceeds the KV cache ({self.capacity.num_kv_blocks * self.capacity.block_size} tokens)"
            )
        self.waiting.append(seq)

    @property
    def num_free_blocks(self) -> int:
        return self.capacity.num_kv_blocks - self._num_reserved_blocks

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_release)

    # -- the three verbs -----------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step: every running sequence decodes; waiting ones join while they fit."""
        batch = list(self.running)
        num_prefill_tokens = 0
        while self.waiting and len(batch) < self.max_batch_size:
            seq = self.waiting[0]
            need = self.blocks_needed(seq)
            prompt = seq.num_prompt_tokens
            over_budget = num_prefill_tokens + prompt > self.max_prefill_tokens and num_prefill_tokens > 0
            if need > self.num_free_blocks or over_budget:
                break
            self.waiting.popleft()
            self._num_reserved_blocks += need
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            num_prefill_tokens += prompt
        if not batch and not self._to_release:
            return None
        plan = StepPlan(self._next_step_id, batch, self._to_release)
        self._next_step_id += 1
        self._to_release = []
        return plan

    def postprocess(self, plan: StepPlan, sampled: dict[int, SampledToken], started_us: int,
                    finished_us: int) -> list[tuple[Sequence, TokenEvent]]:
        """Append each sequence's new token, record its statistics, finish what is done."""
        events = []
        for seq in plan.sequences:
            if seq.is_finished:  # aborted while the step ran
                continue
            token = sampled[seq.seq_id]
            seq.is_sent_to_worker = True
            seq.num_computed_tokens = seq.num_tokens
            seq.output_token_ids.append(token.token_id)
            event = TokenEvent(
                token_id=token.token_id,
                batch_size=plan.batch_size,
                queue_wait_us=max(0, started_us - seq.last_event_us),
                latency_ms=max(0, finished_us - seq.last_event_us) / 1000.0,
                logprob=token.logprob,
                top_logprobs=list(token.top_logprobs),
            )
            seq.last_event_us = finished_us
            self._check_finished(seq, token.token_id)
            events.append((seq, event))
        return events

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (abort or error): it leaves the queue or batch and its KV is released."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._num_reserved_blocks -= self.blocks_needed(seq)
            # Released even if its first step is still in flight: releasing an
            # id the worker does not hold is a no-op, a missed release a leak.
            self._to_release.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def forget_worker_state(self) -> None:
        """The worker restarted or died: nothing it held needs releasing any more."""
        self._to_release = []

    # -- helpers -----------------------------------------------------------
    def _check_finished(self, seq: Sequence, token_id: int) -> None:
        stopping = seq.stopping
        is_eos = token_id in self.capacity.eos_token_ids and not stopping.ignore_eos
        if is_eos or token_id in stopping.stop_token_ids:
            seq.ended_by_stop_token = True
            self.finish(seq, FinishReason.STOP)
        elif len(seq.output_token_ids) >= stopping.max_tokens:
            self.finish(seq, FinishReason.LENGTH)
