"""ChatServicer.Chat over a scripted scheduler: the extra usage-only chunk and
fullTextEnabled from the config reach the gRPC stream; every chunk carries the
system fingerprint; tools are parsed and a forced tool_choice reaches the
scheduler as a grammar."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.errors import ServiceError
from services.common.fingerprint import system_fingerprint
from services.common.model_files import default_model_path, resolve_model
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import ChatServicer, TokenizerCore
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2

TEXT = "Paris is the capital."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


class ScriptedGenerate:
    """Duck-types a Generate call: async iteration and cancel()."""

    def __init__(self, responses):
        self.responses = responses
        self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for response in self.responses:
            if isinstance(response, BaseException):
                raise response  # the call failed
            yield response

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class ScriptedScheduler:
    def __init__(self, responses):
        self.responses = responses
        self.calls: list[ScriptedGenerate] = []
        self.requests: list[scheduler_pb2.GenerateRequest] = []

    def generate(self, request):
        self.requests.append(request)
        self.calls.append(ScriptedGenerate(self.responses))
        return self.calls[-1]


def chat(tokenizer, request: chat_pb2.ChatRequest, text: str = TEXT, scheduler_requests: list | None = None,
         **config) -> list[chat_pb2.ChatChunk]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    responses = [scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(token_id=i, batch_size=1)])
                 for i in ids]
    responses[-1].finish_reason = scheduler_pb2.FINISH_REASON_LENGTH
    scheduler = ScriptedScheduler(responses)
    core = TokenizerCore(TokenizerConfig(model_name="m", **config), tokenizer, "/models/m", 8192)

    async def collect():
        return [r.chunk async for r in ChatServicer(core, scheduler).Chat(request, None)]

    chunks = asyncio.run(collect())
    assert scheduler.calls[0].cancelled  # the scheduler call is always closed
    if scheduler_requests is not None:
        scheduler_requests.extend(scheduler.requests)
    return chunks


def ask(**fields) -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(model="m", messages=[chat_pb2.ChatMessage(role="user", content="hi")], **fields)


def test_include_usage_adds_one_usage_only_chunk_at_the_end(tokenizer):
    chunks = chat(tokenizer, ask(stream=True, stream_options={"include_usage": True}))
    *text_chunks, last = chunks
    assert not any(c.HasField("usage") for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert len(last.choices) == 0 and last.usage.completion_tokens == len(text_chunks)
    assert last.usage.prompt_tokens > 0 and list(last.usage.batch_size) == [1] * len(text_chunks)


def test_every_chunk_carries_the_system_fingerprint_of_the_build_and_model(tokenizer):
    expected = system_fingerprint("m", "/models/m")
    streamed = chat(tokenizer, ask(stream=True, stream_options={"include_usage": True}))
    failed = chat_failing(tokenizer, after_tokens=3)
    assert failed[-1].HasField("error")
    for chunks in (streamed, chat(tokenizer, ask()), failed):  # the usage-only and the error chunk included
        assert [c.system_fingerprint for c in chunks] == [expected] * len(chunks)


def test_without_stream_options_usage_is_on_the_final_choice_chunk(tokenizer):
    chunks = chat(tokenizer, ask(stream=True))
    assert all(len(c.choices) == 1 for c in chunks)
    assert [c.HasField("usage") for c in chunks][-2:] == [False, True]


def test_full_text_enabled_config_reaches_the_stream(tokenizer):
    chunks = chat(tokenizer, ask(stream=True), full_text_enabled=True)
    assert chunks[-1].full_text == TEXT == chunks[-1].choices[0].delta.content
    assert chunks[0].choices[0].delta.content and TEXT.startswith(chunks[1].choices[0].delta.content)
    plain = chat(tokenizer, ask(stream=True))
    assert "".join(c.choices[0].delta.content for c in plain) == TEXT
    assert not plain[-1].HasField("full_text")


CALL = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def with_tool(**fields) -> chat_pb2.ChatRequest:
    request = ask(**fields)
    request.tools.add(type="function").function.name = "ping"
    return request


def test_named_tool_choice_sends_a_lark_grammar_and_the_call_comes_back_parsed(tokenizer):
    sent: list[scheduler_pb2.GenerateRequest] = []
    choice = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name="ping")
    chunks = chat(tokenizer, with_tool(tool_choice=choice), text=CALL, scheduler_requests=sent)
    grammar = sent[0].sampling.grammar
    assert grammar.kind == scheduler_pb2.GRAMMAR_KIND_LARK and '\\"ping\\"' in grammar.source
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("ping", "{}")]
    assert chunks[-1].choices[0].finish_reason == chat_pb2.FINISH_REASON_TOOL_CALLS


def test_tool_choice_none_offers_no_tools_but_still_parses(tokenizer):
    sent: list[scheduler_pb2.GenerateRequest] = []
    none = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_NONE)
    chunks = chat(tokenizer, with_tool(tool_choice=none), text=CALL, scheduler_requests=sent)
    assert not sent[0].sampling.HasField("grammar")
    assert [c.function.name for chunk in chunks for c in chunk.choices[0].delta.tool_calls] == ["ping"]


THOUGHT = "<think>Let me think.</think>Paris."


@pytest.mark.parametrize("kwargs, reasoning_parser, budgeted", [
    ({"thinking_budget": 64}, "qwen3", True),
    ({"thinking_budget": 64, "enable_thinking": True}, "qwen3", True),
    ({"thinking_budget": 64, "enable_thinking": False}, "qwen3", False),  # thinking off: no budget
    ({"thinking_budget": 64}, "none", False),  # the model does not think
    ({}, "qwen3", False),
])
def test_thinking_budget_reaches_the_scheduler_only_when_the_output_thinks(tokenizer, kwargs, reasoning_parser,
                                                                           budgeted):
    sent: list[scheduler_pb2.GenerateRequest] = []
    request = ask()
    request.chat_template_kwargs.update(kwargs)
    chat(tokenizer, request, text=THOUGHT, scheduler_requests=sent, reasoning_parser=reasoning_parser)
    stopping = sent[0].stopping
    assert stopping.HasField("thinking_budget") == budgeted
    if budgeted:
        budget = stopping.thinking_budget
        end = tokenizer.encode("</think>", add_special_tokens=False)
        assert budget.max_tokens == 64 and list(budget.end_token_ids) == end
        assert tokenizer.decode(budget.early_stop_token_ids) == TokenizerConfig().early_stopping_text


def test_beam_search_reaches_the_scheduler_and_its_text_level_conflicts_are_refused(tokenizer):
    sent: list[scheduler_pb2.GenerateRequest] = []
    chat(tokenizer, ask(use_beam_search=True, n=1, best_of=3, max_tokens=8), scheduler_requests=sent)
    assert sent[0].use_beam_search and sent[0].n == 1 and sent[0].best_of == 3
    tool = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name="f"))
    for fields, name in (({"stop": ["."]}, "stop"), ({"tools": [tool]}, "tools")):
        with pytest.raises(ServiceError, match=f"use_beam_search cannot be combined with {name}"):
            chat(tokenizer, ask(use_beam_search=True, max_tokens=8, **fields))


# As grpc.aio ends calls on a GenerateStream whose scheduler went away.
SCHEDULER_DOWN = grpc.aio.AioRpcError(
    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
    details="failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50052: "
            "Failed to connect to remote host: Connection refused")


def chat_failing(tokenizer, after_tokens: int) -> list[chat_pb2.ChatChunk]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:after_tokens]
    responses = [scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(token_id=i, batch_size=1)])
                 for i in ids]
    scheduler = ScriptedScheduler([*responses, SCHEDULER_DOWN])
    core = TokenizerCore(TokenizerConfig(model_name="m"), tokenizer, "/models/m", 8192)

    async def collect():
        return [r.chunk async for r in ChatServicer(core, scheduler).Chat(ask(stream=True, request_id="req-9"), None)]

    return asyncio.run(collect())


def test_a_failed_generate_call_reaches_the_client_without_its_details(tokenizer, caplog):
    # Before any output: the call's status, in our words.
    with pytest.raises(ServiceError) as caught:
        chat_failing(tokenizer, after_tokens=0)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.message == "the service is temporarily unavailable, retry"
    # After some output: a final error chunk, in the same words.
    *_, last = chat_failing(tokenizer, after_tokens=3)
    assert (last.error.code, last.error.message) == (9999, "the service is temporarily unavailable, retry")
    # The details stay in the log, with the request's id.
    logged = [r.getMessage() for r in caplog.records if "127.0.0.1:50052" in r.getMessage()]
    assert len(logged) == 2 and all("req-9" in line for line in logged)
