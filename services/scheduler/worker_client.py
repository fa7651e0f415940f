"""The scheduler's side of WorkerService: one message per engine step on one
step stream, so that the next step can be sent while the last one runs: on
the worker's step channel (frames on a TCP connection of its own, where its
Describe offers one: worker.proto, step_port), else on gRPC's StepStream.
The only module (with convert.py) that touches worker protobufs."""
from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque

import grpc
from grpc_health.v1 import health_pb2

from services.common.errors import STATUS_CODES
from services.common.frames import read_frame, write_frame
from services.common.grpc_server import channel, health_status
from services.common.tls import InternalTls
from services.scheduler.plan import SampledToken, ScheduledSequence, StepAnswer, StepPlan, WorkerCapacity
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc


log = logging.getLogger(__name__)
STEP_CHANNEL_CONNECT_TIMEOUT_S = 5.0


class WorkerError(Exception):
    """The worker failed a step or cannot be reached."""


class StepRefused(WorkerError):
    """The worker refused a step whole (one that contradicts its state: a
    scheduler fault): it is up, but the step stream has ended, and with it the
    state of the sequences on it (the worker forgets them)."""


# Statuses a worker ends its step stream with when it refuses a step on purpose.
# Anything else (UNAVAILABLE, INTERNAL: an exception in the step, such as a
# collective that lost a tensor-parallel rank) leaves the worker in doubt: lost.
_REFUSAL_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})


class WorkerHealth(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not serving"  # loading, or draining: it still answers, and still runs steps
    DOWN = "down"  # does not answer


class _StepChannel:
    """A step stream on the worker's step channel, read and written as grpc.aio's
    StreamStreamCall is (write, read: grpc.aio.EOF at its end, cancel); a
    broken connection raises OSError."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer

    async def write(self, request: worker_pb2.StepStreamRequest) -> None:
        write_frame(self._writer, request)
        await self._writer.drain()

    async def read(self) -> worker_pb2.StepStreamResponse | object:
        frame = await read_frame(self._reader)
        return grpc.aio.EOF if frame is None else worker_pb2.StepStreamResponse.FromString(frame)

    def cancel(self) -> None:
        self._writer.close()


def host_of(address: str) -> str:
    """The host part of a worker's address (host:port, [v6]:port)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


class WorkerClient:
    def __init__(self, address: str, tls: InternalTls | None = None):
        self.address = address
        self._tls = tls
        self._channel = channel(address, tls)  # Describe, health polls, and steps without a step channel
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._steps: grpc.aio.StreamStreamCall | _StepChannel | None = None
        # Each step's steady decodes and how many steps it runs them, of the steps sent and not received.
        self._steady_sent: deque[tuple[list[int], int]] = deque()
        self._step_port = 0  # the worker's step channel, as its last Describe said (0: none)

    async def health(self) -> WorkerHealth:
        status = await health_status(self._channel)
        if status is None:
            return WorkerHealth.DOWN
        return WorkerHealth.SERVING if status == health_pb2.HealthCheckResponse.SERVING else WorkerHealth.NOT_SERVING

    async def describe(self) -> tuple[WorkerCapacity, worker_pb2.DescribeResponse]:
        reply = await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        capacity = WorkerCapacity(
            num_kv_blocks=reply.num_kv_blocks,
            block_size=reply.block_size,
            max_batch_size=reply.max_batch_size,
            eos_token_ids=frozenset(reply.eos_token_ids),
            role=reply.role or "both",
            holds_block_tables=reply.holds_block_tables,
            max_decode_steps=max(1, reply.max_decode_steps),
        )
        self._step_port = reply.step_port
        return capacity, reply

    async def send_blocks(self, peer: worker_pb2.KVPool, src_blocks: list[int], dst_blocks: list[int],
                          timeout_s: float) -> tuple[int, float]:
        """Have this (prefill) worker write its blocks into a peer's pool; (bytes, seconds).
        Raises WorkerError when the transfer failed or did not finish in time."""
        request = worker_pb2.SendBlocksRequest(peer=peer, src_blocks=src_blocks, dst_blocks=dst_blocks)
        try:
            reply = await self._stub.SendBlocks(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise WorkerError(f"worker {self.address}: SendBlocks: {exc.code().name}: {exc.details()}") from exc
        return reply.num_bytes, reply.elapsed_s

    async def _open_steps(self) -> grpc.aio.StreamStreamCall | _StepChannel:
        """The worker's step channel where it offers one and it can be reached, else StepStream."""
        if self._step_port:
            tls, host = self._tls, host_of(self.address)
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, self._step_port, ssl=tls.peer_ssl_context() if tls is not None else None,
                    server_hostname=tls.server_name if tls is not None else None), STEP_CHANNEL_CONNECT_TIMEOUT_S)
                return _StepChannel(reader, writer)
            except (OSError, asyncio.TimeoutError) as exc:
                # A network policy without the port, say: slower, but served.
                log.warning("worker %s: its step channel at %s:%d cannot be reached (%s): steps go on gRPC "
                            "(StepStream) until it rejoins", self.address, host, self._step_port,
                            exc or type(exc).__name__)
                self._step_port = 0
        return self._stub.StepStream()

    async def send(self, plan: StepPlan) -> None:
        """Send a step; its answer comes from `receive`, after those of the steps sent before it."""
        try:
            if self._steps is None:
                self._steps = await self._open_steps()
            request = worker_pb2.StepStreamRequest()
            step_request(plan, request.step)  # built in place: no copy of every sequence into the wrapper
            self._steady_sent.append((plan.steady.seq_ids, plan.steady.steps))
            await self._steps.write(request)
        except grpc.aio.AioRpcError as exc:
            raise self._lost(exc) from exc
        except (grpc.aio.UsageError, asyncio.InvalidStateError, OSError) as exc:  # the stream had already ended
            raise self._lost(exc) from exc

    async def receive(self) -> StepAnswer:
        """The answer to the oldest step sent and not yet received."""
        assert self._steps is not None, "receive before send"
        try:
            reply = await self._steps.read()
        except (grpc.aio.AioRpcError, OSError) as exc:
            raise self._lost(exc) from exc
        if reply is grpc.aio.EOF:
            raise self._lost(None)
        if reply.HasField("error"):  # the step failed: the stream waits for us to end it
            raise self._failed(STATUS_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN), reply.error.message)
        try:
            return step_answer(reply.step, *self._steady_sent.popleft())
        except ValueError as exc:  # not the answer to what was asked: the stream's state is in doubt
            raise self._failed(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc

    def reset(self) -> None:
        """Drop the step stream (steps sent and not received are lost); the next send opens one."""
        if self._steps is not None:
            self._steps.cancel()
            self._steps = None
        self._steady_sent.clear()

    def _lost(self, exc: BaseException | None) -> WorkerError:
        """The step stream has ended: why, as the engine acts on it."""
        if isinstance(exc, grpc.aio.AioRpcError):
            return self._failed(exc.code(), exc.details())
        self.reset()
        return WorkerError(f"worker {self.address}: the step stream ended ({exc or 'closed by the worker'})")

    def _failed(self, code: grpc.StatusCode, details: str | None) -> WorkerError:
        """A step failed with `code` (StepRefused: the worker is up); the stream ends."""
        self.reset()
        error = StepRefused if code in _REFUSAL_CODES else WorkerError
        return error(f"worker {self.address}: {code.name}: {details}")

    async def close(self) -> None:
        self.reset()
        await self._channel.close()


def step_request(plan: StepPlan, into: worker_pb2.StepRequest | None = None) -> worker_pb2.StepRequest:
    """The one Step message for a planned step (filled into `into`, an empty one, if given):
    a decode on the worker's block table (a steady decode, or one planned ahead)
    as its id and new block (decode_seq_ids), any other part as a SequenceStep.

    Each sequence's part is added in place (`add`): a SequenceStep built apart
    and passed in a list is copied into the request, which costs as much again."""
    step = worker_pb2.StepRequest() if into is None else into
    step.step_id = plan.step_id
    step.pack_plain_tokens = True
    steady = plan.steady
    if steady.seq_ids:  # the steady decodes, first (see step_answer): columns already
        step.decode_seq_ids.extend(steady.seq_ids)
        step.decode_new_blocks.extend(steady.new_blocks)
        if steady.steps > 1:
            step.decode_steps = steady.steps
    add = step.sequences.add
    decode_seq_ids, decode_new_blocks = [], []
    for entry in plan.scheduled:
        new_block = entry.extends_table
        if new_block is None:
            _sequence_step(entry, add)
        else:
            decode_seq_ids.append(entry.seq.seq_id)
            decode_new_blocks.append(new_block)
    if decode_seq_ids:
        step.decode_seq_ids.extend(decode_seq_ids)
        step.decode_new_blocks.extend(decode_new_blocks)
    if plan.release_seq_ids:
        step.release_seq_ids.extend(plan.release_seq_ids)
    for src, dst in plan.block_copies:
        step.block_copies.add(src_block=src, dst_block=dst)
    return step


def _sequence_step(entry: ScheduledSequence, add) -> worker_pb2.SequenceStep:
    seq = entry.seq
    step = add(
        seq_id=seq.seq_id,
        token_ids=entry.token_ids,
        num_computed_tokens=entry.num_computed_tokens,
        sample=entry.is_sampling,
        block_table=seq.block_table,
        feed_last_sampled=entry.feeds_last_sampled,
        num_draft_tokens=len(entry.draft_token_ids),
    )
    if entry.sends_sampling:
        step.num_prompt_tokens = seq.num_prompt_tokens
        step.traceparent = seq.traceparent
        s = seq.sampling
        step.sampling.CopyFrom(
            worker_pb2.SamplingParams(
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=s.seed,
                repetition_penalty=s.repetition_penalty,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                top_logprobs=s.top_logprobs,
            )
        )
        if s.grammar is not None:
            kind, source = s.grammar  # GrammarKind numbers are the same in both packages
            step.sampling.grammar.CopyFrom(worker_pb2.Grammar(kind=kind, source=source))
        for image in seq.images:
            if image.offset + image.num_tokens > entry.num_computed_tokens:
                # The message as the request brought it: one copy into the step, no re-encoding.
                step.images.append(image.message)
            else:  # in cached or shared blocks: the worker needs its span (and grid) only
                step.images.add(content_hash=image.content_hash, offset=image.offset, num_tokens=image.num_tokens,
                                grid_thw=image.message.grid_thw)
    return step


def step_answer(reply: worker_pb2.StepResponse, steady_ids: list[int], steps: int = 1) -> StepAnswer:
    """A Step reply as the engine takes it. The step's steady decodes
    (`steady_ids`) are the first of its decodes, and a worker answers plain
    tokens in request order: where every steady decode's token is plain, the
    first plain tokens are theirs, taken as they are (StepAnswer.steady_tokens),
    not by id. That holds when the reply refused nothing and has no token
    entries; else their ids are compared. A message of several `steps` is of
    steady decodes alone, each a plain token a step, step after step: anything
    else is no answer to it (ValueError)."""
    if steps > 1:
        if reply.refused or reply.tokens or list(reply.plain_seq_ids) != steady_ids * steps:
            raise ValueError(f"step {reply.step_id} of {steps} decode steps: the answer is not a plain "
                             f"token for each of its {len(steady_ids)} decodes in each step")
        return StepAnswer({}, {}, list(reply.plain_token_ids))
    num_steady, plain_ids, steady_tokens = len(steady_ids), reply.plain_seq_ids, None
    if num_steady and len(plain_ids) >= num_steady and (
            not (reply.refused or reply.tokens) or plain_ids[:num_steady] == steady_ids):
        steady_tokens = reply.plain_token_ids[:num_steady]
    else:
        num_steady = 0
    refused = {r.seq_id: r.message for r in reply.refused} if reply.refused else {}
    return StepAnswer(sampled_tokens(reply, num_steady), refused, steady_tokens)


def sampled_tokens(reply: worker_pb2.StepResponse, skip: int = 0) -> dict[int, SampledToken | int]:
    """A Step reply's tokens by seq id, a plain one (packed columns) as its id
    alone; without the first `skip` plain ones."""
    plain_ids, plain_tokens = reply.plain_seq_ids, reply.plain_token_ids
    tokens: dict[int, SampledToken | int] = {}
    if len(plain_ids) > skip:
        tokens = dict(zip(plain_ids[skip:], plain_tokens[skip:])) if skip else dict(zip(plain_ids, plain_tokens))
    for t in reply.tokens:
        top, drafts = t.top_logprobs, t.draft_token_ids
        tokens[t.seq_id] = SampledToken(
            t.seq_id,
            t.token_id,
            t.logprob if t.HasField("logprob") else None,
            tuple((a.token_id, a.logprob) for a in top) if top else (),
            t.num_accepted_draft_tokens,
            tuple(drafts) if drafts else (),
        )
    return tokens
