"""Packed entries on a multiplexed stream (services/common/multiplex.py, as the
scheduler's GenerateStream sends plain tokens in GenerateStreamResponse.tokens):
only calls that asked get them, each call's entries come before its events
and never after one in the same response, and the client reads every call's
messages in the order they were made."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

from stormserve.scheduler.v1 import scheduler_pb2

from services.common.multiplex import call_packed, call_reply, serve_calls
from services.common.multiplex_client import CallMultiplexer
from services.tokenizer.server import unpack_tokens

# Per call (its request_id): what its handler does, in order. ("pack", t): token t packed where
# the call may, else as an event; ("event", t): token t as an event; "yield": let the stream write.
SCRIPTS = {
    "a": [("event", 1), ("pack", 2), "yield", ("pack", 3), ("pack", 4), ("event", 5), ("pack", 6), "yield",
          ("pack", 7)],
    "b": [("pack", 10), ("pack", 11), "yield", ("pack", 12)],
}
EXPECTED = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [10, 11, 12]}


async def handle(request: scheduler_pb2.GenerateRequest) -> None:
    reply, pack = call_reply(), call_packed()
    for step in SCRIPTS[request.request_id]:
        if step == "yield":
            await asyncio.sleep(0.01)
            continue
        kind, token = step
        if kind == "pack" and pack is not None and pack(token, (7, 100 + token, 0.5)):
            continue
        reply(scheduler_pb2.GenerateResponse).tokens.add(token_id=token, batch_size=7)


def serve(requests):
    return serve_calls(requests, handle, scheduler_pb2.GenerateStreamResponse, scheduler_pb2.GenerateStreamEvent,
                       packed="tokens")


async def stream_of(*starts: scheduler_pb2.GenerateStreamRequest):
    for start in starts:
        yield start
    await asyncio.sleep(3600)  # the caller keeps the stream open


def start(call_id: int, request_id: str, packed: bool) -> scheduler_pb2.GenerateStreamRequest:
    return scheduler_pb2.GenerateStreamRequest(call_id=call_id, packed_tokens=packed,
                                               start=scheduler_pb2.GenerateRequest(request_id=request_id))


def test_only_calls_that_asked_get_packed_entries_and_each_calls_order_holds() -> None:
    async def main() -> list[scheduler_pb2.GenerateStreamResponse]:
        messages = []
        async with aclosing(serve(stream_of(start(1, "a", True), start(2, "b", False)))) as responses:
            async for message in responses:
                messages.append(message)
                if sum(e.WhichOneof("event") == "end" for m in messages for e in m.events) == 2:
                    return messages
        return messages

    messages = asyncio.run(main())
    received: dict[int, list[int]] = {1: [], 2: []}
    packed: dict[int, list[int]] = {1: [], 2: []}
    for message in messages:
        columns = message.tokens
        assert len({len(columns.call_ids), len(columns.token_ids), len(columns.batch_sizes),
                    len(columns.queue_wait_us), len(columns.latency_ms)}) == 1
        for call_id, token_id, queue_wait_us in zip(columns.call_ids, columns.token_ids, columns.queue_wait_us):
            received[call_id].append(token_id)
            packed[call_id].append(token_id)
            assert queue_wait_us == 100 + token_id
        for event in message.events:  # read after the entries, as the client does
            if event.WhichOneof("event") == "response":
                received[event.call_id] += [t.token_id for t in event.response.tokens]
    assert received == {1: EXPECTED["a"], 2: EXPECTED["b"]}
    # 2 follows an event of a in the same response, 6 follows 5's: both went as events.
    assert packed == {1: [3, 4, 7], 2: []}


class LocalStream:
    """serve_calls behind CallMultiplexer's open_stream, without a network."""

    def __init__(self, requests):
        self._responses = serve(requests)

    def __aiter__(self):
        return self._responses

    def cancel(self) -> None:
        pass


def test_the_client_reads_packed_and_ordinary_messages_in_order() -> None:
    async def read(calls: CallMultiplexer, request_id: str) -> list[scheduler_pb2.GenerateResponse]:
        call = calls.start(scheduler_pb2.GenerateRequest(request_id=request_id))
        return [response async for response in call]

    async def main():
        calls = CallMultiplexer(LocalStream, scheduler_pb2.GenerateStreamRequest, unpack=unpack_tokens)
        try:
            return await asyncio.gather(read(calls, "a"), read(calls, "b"))
        finally:
            await calls.close()

    for request_id, responses in zip("ab", asyncio.run(main())):
        assert [t.token_id for r in responses for t in r.tokens] == EXPECTED[request_id]
        assert all(len(r.tokens) == 1 and r.tokens[0].batch_size == 7 for r in responses)
        packed = [r for r in responses if r.tokens[0].queue_wait_us]
        assert all(r.tokens[0].queue_wait_us == 100 + r.tokens[0].token_id and r.tokens[0].latency_ms == 0.5
                   and not r.tokens[0].HasField("logprob") for r in packed)
        assert len(packed) == 3  # a: 3, 4 and 7; b, which asked this time: all three


def packed_of(runs: bool) -> scheduler_pb2.GenerateStreamResponse:
    """Two steps' tokens of two calls (a run each), then a lone entry of a third."""
    from services.common.multiplex import PackedCall, PackedEntries

    entries = PackedEntries(lambda: None)
    entries.runs = runs
    first, second = (32, 10, 1.5), (32, 20, 2.5)
    assert entries.add_many([1, 2], (5, 6), first) and entries.add_many([1, 2], (7, 8), second)
    assert PackedCall(entries, 3)(9, (32, 20, 2.5)) and PackedCall(entries, 1)(4, (1, 0, 0.0))
    message = scheduler_pb2.GenerateStreamResponse()
    names = [f.name for f in scheduler_pb2.PackedTokens.DESCRIPTOR.fields]
    entries.fill(message.tokens, names)
    assert not entries.call_ids and not entries.run_lengths  # empty again
    return message


def test_runs_carry_the_same_tokens_in_fewer_values_and_a_client_reads_both() -> None:
    per_entry, runs = packed_of(runs=False), packed_of(runs=True)
    assert list(per_entry.tokens.run_lengths) == [] and list(per_entry.tokens.queue_wait_us) == [10, 10, 20, 20, 20, 0]
    assert list(runs.tokens.run_lengths) == [2, 3, 1]  # call 3's equal statistics join the second step's run
    assert list(runs.tokens.queue_wait_us) == [10, 20, 0] and list(runs.tokens.latency_ms) == [1.5, 2.5, 0.0]

    def read(message):
        return [(call_id, r.tokens[0].token_id, r.tokens[0].batch_size, r.tokens[0].queue_wait_us,
                 r.tokens[0].latency_ms) for call_id, r in unpack_tokens(message)]

    expected = [(1, 5, 32, 10, 1.5), (2, 6, 32, 10, 1.5), (1, 7, 32, 20, 2.5), (2, 8, 32, 20, 2.5),
                (3, 9, 32, 20, 2.5), (1, 4, 1, 0, 0.0)]
    assert read(per_entry) == read(runs) == expected


def test_columns_that_do_not_line_up_are_refused_rather_than_read_short() -> None:
    import pytest

    for break_it in (lambda t: t.run_lengths.__setitem__(2, 2), lambda t: t.run_lengths.append(1),
                     lambda t: t.latency_ms.append(0.0), lambda t: t.call_ids.append(4)):
        message = packed_of(runs=True)
        break_it(message.tokens)
        with pytest.raises(ValueError):
            list(unpack_tokens(message))


def test_a_stream_sends_runs_only_while_every_packed_call_asked_for_them() -> None:
    async def main(*starts) -> list[scheduler_pb2.GenerateStreamResponse]:
        messages = []
        async with aclosing(serve(stream_of(*starts))) as responses:
            async for message in responses:
                messages.append(message)
                if sum(e.WhichOneof("event") == "end" for m in messages for e in m.events) == len(starts):
                    return messages
        return messages

    def with_runs(message: scheduler_pb2.GenerateStreamRequest) -> scheduler_pb2.GenerateStreamRequest:
        message.packed_token_runs = True
        return message

    asking = asyncio.run(main(with_runs(start(1, "a", True)), with_runs(start(2, "b", True))))
    mixed = asyncio.run(main(with_runs(start(1, "a", True)), start(2, "b", True)))
    assert any(m.tokens.run_lengths for m in asking)
    assert not any(m.tokens.run_lengths for m in mixed) and any(m.tokens.call_ids for m in mixed)
    for messages in (asking, mixed):
        tokens = {1: [], 2: []}
        for message in messages:
            for call_id, response in unpack_tokens(message):
                tokens[call_id].append(response.tokens[0].token_id)
        assert tokens == {1: [3, 4, 7], 2: [10, 11, 12]}
