"""Prefill/decode disaggregation: a request placed on a prefill worker moves,
once its first token is sampled there, to a decode worker, and goes on there.

The move of one sequence (a task of its own, so the prefill worker's next
steps overlap it):
1. a decode worker is chosen among the ready ones that have room for it, the
   least loaded first (then the most free blocks), and reserves its blocks
   (transfer_steps.py: the decode pool's own prefix-cache hit is not sent);
2. the prefill worker writes its blocks into them (SendBlocks: Mooncake's
   transfer engine, worker to worker; nothing passes through the scheduler),
   tried twice;
3. the request's delivery moves to the decode engine, the sequence joins its
   batch (with its prompt computed, or, after two failed tries, to be
   recomputed there into the same blocks), and the prefill worker's blocks
   are released.
With no decode worker ready, or none with room within ROOM_WAIT_S, the
sequence decodes where it was prefilled. An abort while it moves ends it
where it is. The client sees one stream throughout: its first token came
from the prefill worker.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.errors import WORKER_LOST
from services.scheduler.config import DEFAULT_KV_TRANSFER_TIMEOUT_S
from services.scheduler.engine import EngineLoop, SequenceFailed
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.sequence import FinishReason, Sequence, SequenceStatus
from services.scheduler.worker_client import WorkerError

log = logging.getLogger(__name__)

ROOM_WAIT_S = 5.0  # how long a sequence waits for room on a decode worker before it decodes where it is
ROOM_POLL_S = 0.01


class Handoff:
    def __init__(self, engines: list[EngineLoop], transfer_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S,
                 metrics: SchedulerMetrics | None = None):
        self.engines = engines  # the router's live list
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    def on_prefilled(self, source: EngineLoop, seqs: list[Sequence]) -> None:
        for seq in seqs:
            task = asyncio.create_task(self._move(source, seq))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _decode_engines(self) -> list[EngineLoop]:
        return [e for e in self.engines if e.role == "decode" and e.accepts_sequences and e.info is not None]

    async def _move(self, source: EngineLoop, seq: Sequence) -> None:
        policy = source.policy
        assert policy is not None
        in_flight = self._gauge()
        if in_flight is not None:
            in_flight.inc()
        try:
            target, blocks = await self._reserve(seq)
            target_policy = target.policy if target is not None else None
            outcome = "kept"
            if target is not None:
                outcome = await self._send(source, target, seq, policy.sending_table(seq), blocks)
                if target.policy is not target_policy or not target.is_ready:  # lost meanwhile
                    target, outcome = None, "kept"
            if seq.is_finished:  # aborted meanwhile: what the decode worker reserved goes
                if target is not None:
                    target_policy.drop_received(seq)
                return
            deliver = source.take_delivery(seq.request_id)
            if target is not None:
                if source.policy is policy:
                    policy.sent(seq)
                    source.wake()
                if deliver is not None:
                    target.give_delivery(seq.request_id, deliver)
                target_policy.received(seq, transferred=outcome != "recomputed")
                target.wake()
            elif source.policy is policy and source.is_ready:
                log.warning("%s: no decode worker could take it: it decodes on %s", seq.request_id,
                            source.worker.address)
                policy.keep(seq)
                if deliver is not None:
                    source.give_delivery(seq.request_id, deliver)
                source.wake()
            else:  # neither worker can go on with it
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
                if deliver is not None:
                    deliver([SequenceFailed(WORKER_LOST)])
                return
            self._count(outcome)
        except Exception:  # noqa: BLE001 - a fault here must not leave the request hanging
            log.exception("%s: moving it to a decode worker failed", seq.request_id)
            if not seq.is_finished and source.policy is policy:
                policy.finish(seq, FinishReason.ABORT)
                if (deliver := source.take_delivery(seq.request_id)) is not None:
                    deliver([SequenceFailed("the sequence could not move to a decode worker",
                                            grpc.StatusCode.INTERNAL)])
        finally:
            if in_flight is not None:
                in_flight.dec()

    async def _reserve(self, seq: Sequence) -> tuple[EngineLoop | None, tuple[int, int]]:
        """A decode engine with blocks reserved for `seq`, and the range of its
        table to write; (None, ...) if none has room in time or it ended."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while not seq.is_finished:
            candidates = sorted(self._decode_engines(), key=lambda e: (e.load, -e.policy.num_free_blocks))
            if not candidates:
                break
            for engine in candidates:
                blocks = engine.policy.receive(seq)
                if blocks is not None:
                    return engine, blocks
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(ROOM_POLL_S)
        return None, (0, 0)

    async def _send(self, source: EngineLoop, target: EngineLoop, seq: Sequence, src_table: list[int],
                    blocks: tuple[int, int]) -> str:
        """Send the blocks, twice if need be: sent, retried or recomputed."""
        first, end = blocks
        if first >= end:  # the decode worker's prefix cache holds every full block already
            return "sent"
        src, dst = src_table[first:end], seq.block_table[first:end]
        for attempt in ("sent", "retried"):
            started = time.perf_counter()
            try:
                num_bytes, _ = await source.worker.send_blocks(target.info.kv_pool, src, dst, self.transfer_timeout_s)
            except WorkerError as exc:
                log.warning("%s: KV transfer to %s failed (%s try): %s", seq.request_id, target.worker.address,
                            "first" if attempt == "sent" else "second", exc)
                if seq.is_finished:
                    return attempt
                continue
            if self.metrics is not None:
                name = self.metrics.model_name
                self.metrics.kv_transfer_bytes.labels(name).inc(num_bytes)
                self.metrics.kv_transfer_duration.labels(name).observe(time.perf_counter() - started)
            return attempt
        return "recomputed"

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfers.labels(self.metrics.model_name, outcome).inc()

    def _gauge(self):
        return self.metrics.kv_transfers_in_flight.labels(self.metrics.model_name) if self.metrics else None

