"""tool_choice `required` / a named function as a Lark grammar, driven through
the worker's GuidedDecoding with random logits: whatever the model would say,
the output parses as calls of offered functions with schema-valid arguments."""
from __future__ import annotations

import json

import pytest
import torch

from services.common.errors import ServiceError
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.formats import ModelFormats, OutputOptions
from services.tokenizer.parsers import PARSERS
from services.tokenizer.parsers.reasoning import split_reasoning
from services.tokenizer.tool_grammar import tool_choice_grammar
from services.worker.guided import GrammarSpec, GuidedDecoding
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.tokenizer.tool_fixtures import deepseek_like_tokenizer, smol_tokenizer

EOS = 2
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ORDER = {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}
REQUIRED = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)


def named(name: str) -> chat_pb2.ToolChoice:
    return chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name=name)


def _tool(name: str, schema: dict | None) -> chat_pb2.Tool:
    tool = chat_pb2.Tool(type="function")
    tool.function.name = name
    if schema is not None:
        tool.function.parameters.update(schema)
    return tool


def request(tool_choice: chat_pb2.ToolChoice, **fields) -> chat_pb2.ChatRequest:
    req = chat_pb2.ChatRequest(model="m", tool_choice=tool_choice, **fields)
    for name, schema in (("get_weather", WEATHER), ("get_order", ORDER), ("ping", None)):
        tool = req.tools.add(type="function")
        tool.function.name = name
        if schema is not None:
            tool.function.parameters.update(schema)
    return req


def check_arguments(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "ping":
        assert arguments == "{}"
    elif name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 10 and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) == {"order_id"} and isinstance(args["order_id"], int)


@pytest.fixture(scope="module")
def smol():
    tokenizer = smol_tokenizer()
    formats = ModelFormats.detect(TokenizerConfig(), tokenizer, "llama")
    return tokenizer, formats, GuidedDecoding(tokenizer, 49152, [EOS])


@pytest.fixture(scope="module")
def deepseek_like():
    tokenizer = deepseek_like_tokenizer()
    formats = ModelFormats.detect(TokenizerConfig(tool_call_parser="deepseek_v3"), tokenizer, "llama")
    return tokenizer, formats, GuidedDecoding(tokenizer, len(tokenizer), [EOS])


def walk(tokenizer, guided, grammar: scheduler_pb2.Grammar, seed: int, favour: list[str] = ()) -> str:
    """Greedy over random logits masked by the grammar, pulled towards short
    strings and closing tokens so the walk ends; returns the text."""
    assert grammar.kind == scheduler_pb2.GRAMMAR_KIND_LARK
    matcher = guided.compile(GrammarSpec("lark", grammar.source))
    bias = torch.tensor(sorted({tokenizer.convert_tokens_to_ids(t) for t in ['"', "}", 'Ġ"', *favour]} | {EOS}))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(400):
        logits = torch.randn(1, guided.vocab_size, generator=generator)
        logits[:, bias] += 6.0
        guided.mask_logits(logits, [matcher])
        token = int(logits[0].argmax())
        if token == EOS:
            return tokenizer.decode(tokens, skip_special_tokens=False)
        guided.advance(matcher, token)
        tokens.append(token)
    raise AssertionError("the grammar never let the walk end")


@pytest.mark.parametrize("seed", range(4))
def test_required_hermes_always_parses_as_offered_calls(smol, seed):
    tokenizer, formats, guided = smol
    grammar = tool_choice_grammar(request(REQUIRED), OutputOptions("hermes"), formats)
    text = walk(tokenizer, guided, grammar, seed)
    content, calls = PARSERS["hermes"][1](text)
    assert content == "" and calls, text
    for call in calls:
        check_arguments(call.name, call.arguments)


@pytest.mark.parametrize("name", ["get_weather", "get_order", "ping"])
def test_named_function_is_the_one_call(smol, name):
    tokenizer, formats, guided = smol
    grammar = tool_choice_grammar(request(named(name)), OutputOptions("hermes"), formats)
    for seed in range(2):
        content, calls = PARSERS["hermes"][1](walk(tokenizer, guided, grammar, seed))
        assert content == "" and [c.name for c in calls] == [name]
        check_arguments(name, calls[0].arguments)


def test_reasoning_comes_first_then_the_call(smol):
    tokenizer, formats, guided = smol
    grammar = tool_choice_grammar(request(named("get_order")), OutputOptions("hermes", reasoning=True), formats)
    text = walk(tokenizer, guided, grammar, 0, favour=["</", "think", ">"])
    reasoning, content = split_reasoning(text)
    assert "</think>" in text and reasoning is not None
    assert [c.name for c in PARSERS["hermes"][1](content.lstrip())[1]] == ["get_order"]


@pytest.mark.parametrize("tool_format", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_special_markers_are_named_by_id(deepseek_like, tool_format):
    tokenizer, formats, guided = deepseek_like
    assert formats.special_marker_ids  # the fixture's markers are special tokens
    grammar = tool_choice_grammar(request(REQUIRED), OutputOptions(tool_format), formats)
    assert f"<[{tokenizer.convert_tokens_to_ids('<｜tool▁sep｜>')}]>" in grammar.source
    for seed in range(2):
        text = walk(tokenizer, guided, grammar, seed)
        content, calls = PARSERS[tool_format][1](text)
        assert content == "" and calls, text
        for call in calls:
            check_arguments(call.name, call.arguments)


def test_auto_and_none_are_not_forced(smol):
    _, formats, _ = smol
    for mode in (chat_pb2.TOOL_CHOICE_MODE_AUTO, chat_pb2.TOOL_CHOICE_MODE_NONE):
        assert tool_choice_grammar(request(chat_pb2.ToolChoice(mode=mode)), OutputOptions("hermes"), formats) is None


@pytest.mark.parametrize("req, options, message", [
    (request(named("nope")), OutputOptions("hermes"), "not in tools"),
    (chat_pb2.ChatRequest(tool_choice=REQUIRED), OutputOptions(), "needs tools"),
    (request(REQUIRED, response_format={"type": chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT}),
     OutputOptions("hermes"), "response_format"),
    (request(named("flags"), tools=[_tool("flags", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "boolean"}}}})]), OutputOptions("chatglm3"), "nests a boolean"),
])
def test_what_cannot_be_forced_is_refused(smol, req, options, message):
    with pytest.raises(ServiceError, match=message):
        tool_choice_grammar(req, options, smol[1])


GLM_FAVOUR = [")", "```", "``", "`"]


@pytest.mark.parametrize("choice", [REQUIRED, named("get_weather"), named("get_order"), named("ping")])
def test_chatglm3_forced_call_is_one_python_call_of_an_offered_function(smol, choice):
    tokenizer, formats, guided = smol
    grammar = tool_choice_grammar(request(choice), OutputOptions("chatglm3"), formats)
    for seed in range(2):
        text = walk(tokenizer, guided, grammar, seed, favour=GLM_FAVOUR)
        content, calls = PARSERS["chatglm3"][1](text)
        assert content == "" and len(calls) == 1, text
        if choice.mode == chat_pb2.TOOL_CHOICE_MODE_FUNCTION:
            assert calls[0].name == choice.function_name
        check_arguments(calls[0].name, calls[0].arguments)


def test_chatglm3_writes_python_booleans_and_may_skip_optional_arguments(smol):
    tokenizer, formats, guided = smol
    schema = {"type": "object", "properties": {"verbose": {"type": "boolean"}, "limit": {"type": "integer"},
                                               "note": {"type": ["null"]}}}
    req = chat_pb2.ChatRequest(model="m", tool_choice=named("search"), tools=[_tool("search", schema)])
    grammar = tool_choice_grammar(req, OutputOptions("chatglm3"), formats)
    assert '("True" | "False")' in grammar.source and '"None"' in grammar.source
    seen = set()
    for seed in range(6):
        # Argument names pulled as hard as the closing ")": each walk picks by the noise.
        text = walk(tokenizer, guided, grammar, seed, favour=GLM_FAVOUR + ["verbose", "limit", "note", "True"])
        content, calls = PARSERS["chatglm3"][1](text)
        assert content == "" and [c.name for c in calls] == ["search"], text
        args = json.loads(calls[0].arguments)
        assert set(args) <= {"verbose", "limit", "note"}
        assert all(isinstance(args[k], t) for k, t in (("verbose", bool), ("limit", int)) if k in args)
        assert args.get("note") is None
        seen.add(tuple(sorted(args)))
    assert len(seen) > 1  # optional arguments really are optional
