"""WorkerService wiring: Describe, and Step run on one dedicated thread so the
asyncio loop (health checks, other calls) never waits on the model.

Loading and warm-up run on that same thread: every thread that runs torch ops
gets its own OpenMP team, and with a second team around (one thread loads, the
other steps) decode steps measured 20 to 40 % slower on a 2-core machine.

Drain: on SIGTERM the worker's health turns NOT_SERVING, which the scheduler
reads as "draining" (no new sequences here) as long as steps are still
answered; the running sequences go on until the scheduler has released them
all, then the worker exits. New step streams are refused. At the drain timeout
an open step stream ends with UNAVAILABLE naming it, and the scheduler ends the
sequences it carried with that error.

A failed step on a step stream is answered with its status in the stream, which
then waits for the caller to end it: a scheduler writing its next step as the
stream ended would otherwise read its own write's error, not the step's."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import tracing
from services.common.drain import Drain
from services.common.errors import ServiceError, status_proto
from services.worker import convert
from services.worker.kv_transfer import KVTransfer, KVTransferError
from services.worker.model_runner import ModelRunner
from services.worker.spans import StepSpans
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class _StreamState:
    """Shared by the steps of one stream: once one fails, the rest are not run.
    `seq_ids`: the sequences its steps started and have not released; `spans`:
    their trace spans, with tracing on (on the scheduler's step stream only)."""

    def __init__(self, traced: bool = False):
        self.failed = False
        self.seq_ids: set[int] = set()
        self.spans = StepSpans() if traced and tracing.enabled else None


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Answers UNAVAILABLE until `attach` hands it a loaded, warmed-up runner."""

    def __init__(self, runner: ModelRunner | None = None, drain: Drain | None = None):
        # One thread: steps are strictly ordered and the runner is single-threaded.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-step")
        self._runner: ModelRunner | None = None
        self._description: worker_pb2.DescribeResponse | None = None
        self.drain = drain or Drain("worker")
        self.drain.listen(self._on_drain)
        self._steps_in_flight = 0
        # A prefill or decode worker's end of KV transfers; its sends run on threads of their own.
        self._transfer: KVTransfer | None = None
        self._sender = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-send")
        self.step_port = 0  # the step channel's, once it listens (step_channel.py); 0: StepStream alone
        if runner is not None:
            self.attach(runner)

    async def load(self, loader: Callable[[], ModelRunner]) -> None:
        """Run `loader` (load, warm up) on the step thread, then serve its runner."""
        self.attach(await asyncio.get_running_loop().run_in_executor(self._executor, loader))

    def attach(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._description = convert.describe_to_proto(runner.describe())
        self._description.step_port = self.step_port

    def attach_transfer(self, role: str, transfer: KVTransfer) -> None:
        """A prefill or decode worker's: its pool's transfer engine, and its role, in Describe."""
        assert self._description is not None, "attach the runner first"
        self._transfer = transfer
        self._description.role = role
        convert.pool_to_proto(transfer.describe(), self._description.kv_pool)

    @property
    def runner(self) -> ModelRunner | None:
        return self._runner

    def _require_runner(self) -> ModelRunner:
        if self._runner is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self._runner

    async def Describe(self, request: worker_pb2.DescribeRequest, context) -> worker_pb2.DescribeResponse:
        self._require_runner()
        return self._description

    async def SendBlocks(self, request: worker_pb2.SendBlocksRequest, context) -> worker_pb2.SendBlocksResponse:
        """Not refused while draining: the blocks sent are of sequences this worker still holds."""
        self._require_runner()
        if self._transfer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "this worker's role is both: it sends no KV blocks")
        peer = convert.pool_from_proto(request.peer)
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._sender, self._transfer.send_blocks, peer, list(request.src_blocks), list(request.dst_blocks))
        except KVTransferError as exc:
            log.warning("%s", exc)
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED if exc.timed_out else grpc.StatusCode.UNAVAILABLE,
                               str(exc)) from exc
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        return worker_pb2.SendBlocksResponse(num_bytes=result.num_bytes, elapsed_s=result.elapsed_s)

    def _on_drain(self) -> None:
        state = "timed out" if self.drain.expired else "draining"
        log.info("%s with %d sequences running", state, self.num_sequences)

    @property
    def num_sequences(self) -> int:
        """Sequences whose state the runner holds (the scheduler has not released them)."""
        return 0 if self._runner is None else len(self._runner.sequences)

    def is_idle(self) -> bool:
        """No sequence held and no step running: a draining worker may go."""
        return self.num_sequences == 0 and self._steps_in_flight == 0

    async def Step(self, request: worker_pb2.StepRequest, context) -> worker_pb2.StepResponse:
        return await self._submit(request, _StreamState())

    async def StepStream(self, request_iterator, context):
        async for response in self.step_stream(request_iterator):
            yield response

    async def step_stream(self, request_iterator):
        """A step stream, on gRPC (StepStream) or on the step channel (step_channel.py):
        each step goes to the step thread as soon as it arrives (the thread runs
        them in arrival order), and the answers go back in that order.

        A scheduler drives its sequences on one stream; when the stream ends (the
        scheduler stopped, was restarted, or found this worker lost) nothing will
        release the sequences still on it, and a restarted scheduler numbers its
        sequences from 1 again: they are forgotten, after the stream's last step.
        Raises the drain's errors: refused when draining, expired at its timeout."""
        self.drain.refuse_new()
        try:
            with self.drain.carrying(asyncio.current_task(), count=False):
                async for response in self._step_stream(request_iterator):
                    yield response
        except asyncio.CancelledError:
            if not self.drain.expired:
                raise
            raise self.drain.expiry_error() from None

    async def _step_stream(self, request_iterator):
        state = _StreamState(traced=True)
        answers: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()

        async def read() -> None:
            async for message in request_iterator:
                answers.put_nowait(asyncio.create_task(self._submit(message.step, state)))
            answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                try:
                    response = await answer
                except Exception as exc:  # noqa: BLE001 - answered in the stream, as worker.proto says
                    yield worker_pb2.StepStreamResponse(error=status_proto(exc))
                    # Later steps are not run (state.failed): the caller ends the stream.
                    while (pending := await answers.get()) is not None:
                        await asyncio.gather(pending, return_exceptions=True)
                    break
                yield worker_pb2.StepStreamResponse(step=response)
            await reader
        finally:
            reader.cancel()
            while not answers.empty():
                if (pending := answers.get_nowait()) is not None:
                    pending.cancel()
            if state.seq_ids:
                # On the step thread: after any step of this stream still running there.
                self._executor.submit(self._forget, sorted(state.seq_ids))
            if state.spans is not None:
                state.spans.close()

    def _forget(self, seq_ids: list[int]) -> None:
        if self._runner is not None:
            for seq_id in seq_ids:
                self._runner.release(seq_id)
        log.info("step stream ended: forgot the %d sequences its scheduler left", len(seq_ids))

    async def _submit(self, request: worker_pb2.StepRequest, state: _StreamState) -> worker_pb2.StepResponse:
        # Hands the step to the step thread before its first await: steps submitted
        # one after the other (tasks start in creation order) run in that order.
        try:
            runner = self._require_runner()
            inputs, release_seq_ids, block_copies = convert.step_from_proto(request)
        except BaseException:
            state.failed = True
            raise
        state.seq_ids.difference_update(release_seq_ids)  # released before the step runs its sequences
        state.seq_ids.update(s.seq_id for s in inputs)

        times = [0, 0]  # when the step ran on the step thread (ns), for its span

        def run() -> worker_pb2.StepResponse:
            times[0] = time.time_ns()
            if state.failed:
                raise ServiceError(grpc.StatusCode.ABORTED, "an earlier step on this stream failed")
            try:
                result = runner.step(inputs, release_seq_ids, block_copies, request.decode_steps or 1)
            except BaseException:
                state.failed = True
                raise
            finally:
                times[1] = time.time_ns()
            log.debug(
                "step %d: %d sequences, %d tokens, %d released, %d copies, %.1f ms",
                request.step_id, len(inputs), sum(len(s.token_ids) for s in inputs),
                len(release_seq_ids), len(block_copies), result.execute_time_us / 1000,
            )
            return convert.step_to_proto(request.step_id, result, pack_plain=request.pack_plain_tokens)

        self._steps_in_flight += 1
        ok = False
        try:
            response = await asyncio.get_running_loop().run_in_executor(self._executor, run)
            ok = True
            return response
        finally:
            self._steps_in_flight -= 1
            if state.spans is not None and times[0]:
                state.spans.on_step(request, times[0], times[1] or time.time_ns(), ok)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._sender.shutdown(wait=True)
        if self._transfer is not None:
            self._transfer.close()
