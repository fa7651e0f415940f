"""One choice's output split into reasoning, content and tool calls.

Order: reasoning first (tool calls are parsed only after `</think>`, as MindIE
does), then the tool format. A stream parses tool calls as the text arrives
(OpenAI delta shape); a non-stream reply parses the whole content at the end,
so an invalid block leaves every call as plain content, as the reference does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer.formats import OutputOptions
from services.tokenizer.parsers import PARSERS
from services.tokenizer.parsers.base import ToolCall, ToolCallDelta
from services.tokenizer.parsers.reasoning import ReasoningParser
from stormserve.chat.v1 import chat_pb2


@dataclass
class Parsed:
    """What is ready to send: new text of each kind and tool-call entries."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[chat_pb2.ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


def stream_entries(deltas: list[ToolCallDelta]) -> list[chat_pb2.ToolCall]:
    """Parser deltas in the OpenAI stream shape: a call opens with
    `{index, id, type, function: {name, arguments: ""}}`, then arguments
    fragments `{index, function: {arguments}}` (adjacent ones merged)."""
    out: list[chat_pb2.ToolCall] = []
    for d in deltas:
        if d.id:
            out.append(chat_pb2.ToolCall(index=d.index, id=d.id, type="function",
                                         function=chat_pb2.FunctionCall(name=d.name or "")))
        if not d.arguments:
            continue
        if out and out[-1].index == d.index and not out[-1].id:
            out[-1].function.arguments += d.arguments
        else:
            out.append(chat_pb2.ToolCall(index=d.index, function=chat_pb2.FunctionCall(arguments=d.arguments)))
    return out


def complete_entries(calls: list[ToolCall]) -> list[chat_pb2.ToolCall]:
    return [chat_pb2.ToolCall(index=i, id=c.id, type="function",
                              function=chat_pb2.FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)]


class OutputParser:
    def __init__(self, options: OutputOptions, stream: bool):
        self.reasoning_enabled = options.reasoning
        self._reasoning = ReasoningParser(options.reasoning)
        self._tools = None
        self._parse_complete = None
        if options.tool_parser is not None:
            stream_parser, self._parse_complete = PARSERS[options.tool_parser]
            self._tools = stream_parser() if stream else None
        self._content = ""  # non-stream with tools: the whole content, parsed at the end
        self.reasoning_tokens = 0
        self.has_tool_calls = False

    def feed(self, text: str, tokens: int = 1) -> Parsed:
        """`text` is what `tokens` new tokens completed (after stop strings);
        the tokens count as reasoning while the think block is still open."""
        reasoning, content = self._reasoning.feed(text)
        if self._reasoning.is_reasoning:
            self.reasoning_tokens += tokens
        return self._with_content(Parsed(reasoning=reasoning), content)

    def finish(self) -> Parsed:
        """The rest, at the end of the output: held text and, non-stream, the calls."""
        reasoning, content = self._reasoning.flush()
        out = self._with_content(Parsed(reasoning=reasoning), content)
        if self._tools is not None:
            rest = self._tools.flush()
            out.content += rest.content
            out.tool_calls += self._entries(rest.tool_calls)
        elif self._parse_complete is not None:
            text, calls = self._parse_complete(self._content)
            out.content += text
            out.tool_calls += complete_entries(calls)
            self.has_tool_calls = bool(calls)
        return out

    def _with_content(self, out: Parsed, content: str) -> Parsed:
        if self._parse_complete is None:
            out.content += content
        elif self._tools is None:
            self._content += content
        else:
            delta = self._tools.feed(content)
            out.content += delta.content
            out.tool_calls += self._entries(delta.tool_calls)
        return out

    def _entries(self, deltas: list[ToolCallDelta]) -> list[chat_pb2.ToolCall]:
        self.has_tool_calls = self.has_tool_calls or bool(deltas)
        return stream_entries(deltas)
