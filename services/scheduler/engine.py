"""The engine loop for one worker: plan, execute, account — and deliver each
token to its request's stream. Also watches the worker's health: when it is
down (does not answer) its in-flight requests end with an error and new ones
go elsewhere; it rejoins when healthy again. A worker that answers NOT_SERVING
after it was ready is draining (it got SIGTERM): it takes no new sequences,
and the ones it has run to the end, unless its step stream breaks.

A worker may refuse one sequence of a step (what its request asks is out of
the worker's ranges): that request alone ends, with INVALID_ARGUMENT and the
worker's words. A step it refuses whole (a fault of the scheduler's) ends the
sequences on it, whose worker state went with the step stream, but the worker
stays in service: only a worker that cannot be reached is lost. A fault of the
step loop's own (a scheduler bug) ends them the same way, and the loop goes on.

Steps are pipelined one deep: once step N is sent, step N+1 is planned and sent
before N's answer is awaited (the policy plans from where N leaves each
sequence), so the worker starts N+1 as soon as N is done instead of waiting for
the scheduler to account for N and plan again."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.errors import STEP_FAILED, STEP_LOOP_FAILED, WORKER_LOST
from services.scheduler.metrics import EngineMetrics
from services.scheduler.plan import StepAnswer
from services.scheduler.policy import BatchPolicy, StepPlan, WorkerCapacity
from services.scheduler.sequence import FinishReason, Sequence, SequenceStatus, TokenEvent
from services.scheduler.speculation import SpeculationConfig, Speculator
from services.scheduler.worker_client import StepRefused, WorkerClient, WorkerError, WorkerHealth

log = logging.getLogger(__name__)
HEALTH_POLL_S = 1.0


class LoopSlices:
    """Engines share the event loop's iterations: once `slice_s` of engine work
    has run in one iteration, the next engine's step waits for the next one.

    Under full load every engine's step answer is ready at once (a worker's
    step channel answers within µs), and asyncio runs every ready engine in one
    iteration: at 16 workers, one iteration ran about 3 ms of steps. Everything
    else waits for iterations — reading a gRPC message (a new call on a
    GenerateStream) takes two — so new calls came in about 7 times slower:
    bench.scheduler_throughput admitted 1,024 calls on 4 streams in 5-6 s
    instead of 0.8 s, and never got 4,096 calls running. With 0.5 ms slices:
    1.0 and 4.5 s; 1 ms slices took 1.8 and 7.2 s."""

    def __init__(self, slice_s: float = 5e-4):
        self.slice_s = slice_s
        self._started = 0.0  # when this iteration's first step began; 0.0 until one does
        # One future per engine waiting for the next iteration, done when it begins: each its
        # own, as cancelling a task (an engine that stops) cancels the future it awaits.
        self._waiting: list[asyncio.Future] = []

    async def take(self) -> None:
        """Return once this step may run in the current iteration."""
        while True:
            now = time.perf_counter()
            if not self._started:
                self._started = now
                asyncio.get_running_loop().call_soon(self._new_iteration)
                return
            if now - self._started < self.slice_s:
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            await waiter

    def _new_iteration(self) -> None:
        self._started = 0.0
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():  # else its engine stopped while it waited
                waiter.set_result(None)


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass
class SequenceFailed:
    """Delivered instead of a token when the sequence cannot go on: its request
    ends with `code` and `message` (written for the client)."""

    message: str
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE


# What the engine delivers to a request: its sequences' tokens, or a
# SequenceFailed alone (then nothing more); an empty list after an abort, so that the
# request sees those sequences finished. Called in the engine's loop, once per
# step per request with all of its tokens, and must not raise.
StreamItem = tuple[Sequence, TokenEvent] | SequenceFailed
Deliver = Callable[[list[StreamItem]], None]


class EngineLoop:
    def __init__(self, worker: WorkerClient, max_batch_size: int, max_prefill_tokens: int,
                 speculation: SpeculationConfig = SpeculationConfig(), slices: LoopSlices | None = None,
                 max_decode_steps: int = 1):
        self.worker = worker
        self.slices = slices or LoopSlices()  # one for all of a process's engines
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_decode_steps = max_decode_steps
        # Outlives policies: its counts are the metrics', its global suffix counts stay useful.
        self.speculator = Speculator(speculation)
        self.policy: BatchPolicy | None = None
        self.num_steps = 0
        self.num_sequences = 0  # placed here since start
        self.metrics: EngineMetrics | None = None  # set when metrics are on
        # Prefix-cache queries and hits (tokens) and preemptions of the policies before the current one.
        self._retired_counts = (0, 0, 0)
        self.created_s = time.time()  # when those counts and the speculator's began: their `_created`
        # Per request id: where its items go, from submit to detach.
        self._deliver_to: dict[str, Deliver] = {}
        self._wakeup = asyncio.Event()
        self._ready = asyncio.Event()
        self.is_draining = False
        self._tasks: list[asyncio.Task] = []
        # The worker's last Describe answer, and a check of it before the worker
        # may join (the router's: the same model as the others); it returns why not.
        self.info = None
        self.admit: Callable[[object], str | None] | None = None
        # Prefill/decode disaggregation: given the sequences whose KV is to move (handoff.py).
        self.on_prefilled: Callable[[EngineLoop, list[Sequence]], None] | None = None
        self._refused: str | None = None  # the last refusal logged

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    @property
    def accepts_sequences(self) -> bool:
        """Ready and not draining: new sequences may be placed here."""
        return self.is_ready and not self.is_draining

    @property
    def role(self) -> str:
        """The worker's: prefill, decode or both."""
        return self.policy.capacity.role if self.policy else "both"

    def wake(self) -> None:
        """Plan again: the policy changed outside a step (a sequence moved in or out)."""
        self._wakeup.set()

    def take_delivery(self, request_id: str) -> Deliver | None:
        """Stop delivering a request here (it moves on to another engine); where it went."""
        return self._deliver_to.pop(request_id, None)

    def give_delivery(self, request_id: str, deliver: Deliver) -> None:
        self._deliver_to[request_id] = deliver

    def delivers(self, request_id: str) -> bool:
        return request_id in self._deliver_to

    @property
    def load(self) -> int:
        return self.policy.num_unfinished if self.policy else 0

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of `seq` this worker's prefix cache holds now."""
        return self.policy.num_cached_prefix_tokens(seq) if self.policy else 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch_health()), asyncio.create_task(self._run())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.worker.close()

    async def retire(self, reason: str) -> None:
        """The worker left for good: its in-flight requests fail, the loop stops."""
        self._fail_all(reason)
        await self.stop()

    def submit(self, seqs: list[Sequence], deliver: Deliver) -> None:
        """Queue one request's sequences (siblings, or beam search result
        placeholders); everything of that request id goes to `deliver`, until
        `detach`. Raises CapacityError if they can never fit."""
        assert self.policy is not None and self.is_ready
        self.policy.add_group(seqs)
        self.num_sequences += len(seqs)
        self._deliver_to[seqs[0].request_id] = deliver
        self._wakeup.set()

    def abort(self, seqs: list[Sequence]) -> None:
        """End some of a request's unfinished sequences; their KV is released with the
        next step. The request is delivered nothing, to see them finished."""
        if self.policy is not None:
            for seq in seqs:
                self.policy.finish(seq, FinishReason.ABORT)
            self._wakeup.set()
        if seqs and (deliver := self._deliver_to.get(seqs[0].request_id)) is not None:
            deliver([])

    def detach(self, request_id: str) -> None:
        """The request's Generate call ended: nothing more is delivered to it."""
        self._deliver_to.pop(request_id, None)

    async def _run(self) -> None:
        """The step loop, started afresh after a fault of its own (a scheduler bug):
        the requests on this worker end with an error rather than wait on a loop
        that died, and the worker takes new ones from a fresh plan of its blocks,
        as after a step it refused whole."""
        while True:
            try:
                await self._steps()
            except Exception:  # noqa: BLE001 - anything but cancellation: the loop must go on
                log.exception("worker %s: the step loop failed; the requests on it end", self.worker.address)
                self.worker.reset()
                if self.policy is not None:
                    self._end_all(STEP_LOOP_FAILED, "the step loop failed")
                    self._new_policy(self.policy.capacity)

    async def _steps(self) -> None:
        # Steps sent and not answered yet, oldest first: the policy that planned
        # each (a lost worker gets a new one), the plan, and when it was sent.
        sent: deque[tuple[BatchPolicy, StepPlan, int]] = deque()
        last_answer_us = 0
        while True:
            await self._ready.wait()
            policy = self.policy
            assert policy is not None
            if sent and sent[0][0] is not policy:  # the worker was lost: those answers will not come
                sent.clear()
                self.worker.reset()
            plan = None
            if len(sent) < 2:
                planning_ns = time.perf_counter_ns()
                plan = policy.schedule()
                if plan is not None and self.metrics is not None:  # per step, of the plan's steps
                    steps = plan.steady.steps
                    self.metrics.step_planning.observe((time.perf_counter_ns() - planning_ns) * 1e-9 / steps, steps)
            if plan is not None:
                try:
                    await self.worker.send(plan)
                except WorkerError as exc:
                    self._step_failed(policy, plan, exc)
                    sent.clear()
                    continue
                sent.append((policy, plan, now_us()))
                if len(sent) < 2:
                    continue  # plan the next step while this one runs
            if not sent:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            planned_by, plan, sent_us = sent.popleft()
            try:
                answer = await self.worker.receive()
            except WorkerError as exc:
                self._step_failed(planned_by, plan, exc)
                sent.clear()
                continue
            await self.slices.take()
            finished_us = now_us()
            # Queued behind the step before it, it started when that one was done.
            started_us, last_answer_us = max(sent_us, last_answer_us), finished_us
            self.num_steps += plan.steady.steps
            if answer.refused:
                self._refused_sequences(planned_by, plan, answer)
            events = planned_by.postprocess(plan, answer.tokens, started_us, finished_us, answer.steady_tokens)
            if self.metrics is not None:
                self.metrics.on_step(plan, events, started_us, finished_us, planned_by.packed_stats)
            self._deliver(events)
            if planned_by.prefill_only and (moving := planned_by.take_prefilled()) and self.on_prefilled:
                self.on_prefilled(self, moving)

    def _deliver(self, events: list[tuple[Sequence, TokenEvent]]) -> None:
        """A step's tokens, all of a request's at once."""
        by_request: dict[str, list[StreamItem]] = {}
        for item in events:
            request_id = item[0].request_id
            items = by_request.get(request_id)
            if items is None:
                by_request[request_id] = [item]
            else:
                items.append(item)
        deliver_to = self._deliver_to
        for request_id, items in by_request.items():
            deliver = deliver_to.get(request_id)
            if deliver is not None:
                deliver(items)

    def _refused_sequences(self, policy: BatchPolicy, plan: StepPlan, answer: StepAnswer) -> None:
        """The worker left these sequences out of the step: each one's request ends
        (all its sequences, freed as on an abort) with INVALID_ARGUMENT and the
        worker's message. A refusal of a sequence ended or preempted since the
        step was planned (refused in the step before, when this one was planned
        ahead) changes nothing."""
        running = SequenceStatus.RUNNING
        parts = [(entry.seq, entry.epoch) for entry in plan.scheduled]
        parts += [(seq, seq.epoch) for seq in plan.steady.seqs if seq.status is running]  # see _take_steady
        for seq, epoch in parts:
            message = answer.refused.get(seq.seq_id)
            if message is None or seq.is_finished or epoch != seq.epoch:
                continue
            log.warning("%s: the worker refused sequence %d: %s", seq.request_id, seq.seq_id, message)
            for sibling in policy.unfinished_sequences():
                if sibling.request_id == seq.request_id:  # a beam search ends whole through a result
                    policy.finish(sibling if sibling.beam is None else sibling.beam.results[0], FinishReason.ABORT)
            deliver = self._deliver_to.get(seq.request_id)
            if deliver is not None:
                deliver([SequenceFailed(message, grpc.StatusCode.INVALID_ARGUMENT)])

    def _step_failed(self, planned_by: BatchPolicy, plan: StepPlan, exc: WorkerError) -> None:
        log.error("step %d failed: %s", plan.step_id, exc)
        if planned_by is not self.policy:  # the worker was already found lost
            return
        if not isinstance(exc, StepRefused):
            self._fail_all(str(exc))
            return
        # The worker is up: the sequences on it end (their state went with the step
        # stream), and it takes new ones at once, from a fresh plan of its blocks.
        assert self.policy is not None
        self._end_all(STEP_FAILED, str(exc))
        self._new_policy(self.policy.capacity)

    def _fail_all(self, message: str) -> None:
        """The worker's KV state is gone: every sequence on it ends with an error."""
        self._ready.clear()
        self._end_all(WORKER_LOST, message)

    def _end_all(self, client_message: str, message: str) -> None:
        """End every unfinished sequence: its request gets `client_message`, the log `message`."""
        policy = self.policy
        if policy is None:
            return
        failed = set()
        for seq in policy.unfinished_sequences():
            policy.finish(seq, FinishReason.ABORT)
            deliver = self._deliver_to.get(seq.request_id)
            if deliver is not None and seq.request_id not in failed:
                failed.add(seq.request_id)
                log.error("%s: %s (%s)", seq.request_id, client_message, message)
                deliver([SequenceFailed(client_message)])
        policy.forget_worker_state()

    async def _watch_health(self) -> None:
        while True:
            await self.on_health(await self.worker.health())
            await asyncio.sleep(HEALTH_POLL_S)

    async def on_health(self, health: WorkerHealth) -> None:
        address = self.worker.address
        if health is WorkerHealth.SERVING and not self.is_ready:
            try:
                capacity, info = await self.worker.describe()
            except Exception as exc:  # noqa: BLE001 - retried on the next poll
                log.warning("describe %s failed: %s", address, exc)
            else:
                refusal = self.admit(info) if self.admit is not None else None
                if refusal is not None:
                    if refusal != self._refused:  # once, not every poll
                        log.error("worker %s refused: %s", address, refusal)
                    self._refused = refusal
                    return
                self.info = info
                self._become_ready(capacity)
                log.info("worker %s ready: %s, %d KV blocks of %d tokens",
                         address, info.model_path, capacity.num_kv_blocks, capacity.block_size)
        elif health is WorkerHealth.SERVING and self.is_draining:
            log.info("worker %s is serving again", address)
            self.is_draining = False
        elif health is WorkerHealth.NOT_SERVING and self.is_ready and not self.is_draining:
            log.info("worker %s is draining: no new sequences; its %d unfinished ones go on", address, self.load)
            self.is_draining = True
        elif health is WorkerHealth.DOWN and self.is_ready:
            if self.is_draining and self.load == 0:
                log.info("worker %s drained and left", address)
                self._ready.clear()
                self.worker.reset()
            else:
                log.error("worker %s is not serving", address)
                self._fail_all(f"worker {address} is not serving")

    def cache_counts(self) -> tuple[int, int, int]:
        """Prefix-cache queries and hits in tokens, and preemptions, since start."""
        queries, hits, preemptions = self._retired_counts
        if self.policy is not None:
            queries += self.policy.num_queried_tokens
            hits += self.policy.num_cached_tokens
            preemptions += self.policy.num_preemptions
        return queries, hits, preemptions

    def _become_ready(self, capacity: WorkerCapacity) -> None:
        # A (re)started worker holds no KV state: start from a fresh policy.
        self._new_policy(capacity)
        self.is_draining = False
        self._ready.set()

    def _new_policy(self, capacity: WorkerCapacity) -> None:
        self._retired_counts = self.cache_counts()
        self.policy = BatchPolicy(capacity, self.max_batch_size, self.max_prefill_tokens, self.speculator,
                                  self.max_decode_steps)
        self._wakeup.set()
