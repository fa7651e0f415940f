"""Qwen2.5 / Qwen3 (Hermes-style) tool calls: one or more
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Streaming: text before a block is content; a block's first delta carries id,
type and name as soon as the name is known, then the raw text of the
`arguments` object streams as it arrives (so the fragments concatenate to
valid JSON, `{}` included). Blocks whose JSON is not in that order are
buffered and emitted whole at `</tool_call>`.
"""
from __future__ import annotations

import json
import re

from services.tokenizer.parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    new_call_id,
    partial_marker_suffix,
)
from services.tokenizer.parsers.json_scan import JsonValueScanner

START, END = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)


def _arguments_text(value) -> str:
    if isinstance(value, str):
        json.loads(value)  # a string must itself hold JSON
        return value
    return json.dumps(value, ensure_ascii=False)


def parse_complete(text: str) -> tuple[str, list[ToolCall]]:
    """Non-stream: content before the first block and the calls; any invalid
    block means no calls and the text stays content (as the reference does)."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    try:
        for block in blocks:
            obj = json.loads(block)
            calls.append(ToolCall(new_call_id(), str(obj["name"]), _arguments_text(obj.get("arguments", {}))))
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[: text.index(START)], calls


class HermesToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._in_block = False
        self._index = -1
        self._name_sent = False
        self._scanner: JsonValueScanner | None = None
        self._args_done = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if not self._in_block:
                start = self._buffer.find(START)
                if start < 0:
                    keep = partial_marker_suffix(self._buffer, (START,))
                    self._emit_content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                self._emit_content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(START):]
                self._open_block()
            if not self._advance_block(out):
                return out

    def flush(self) -> ParsedDelta:
        """End of output: an unfinished block's text is returned as content."""
        if self._in_block and self._name_sent:
            text = ""  # a call cut short: what it had was already streamed
        elif self._in_block:
            # Not a call after all; after earlier calls it is dropped, like
            # any text there (see _emit_content).
            text = START + self._buffer if self._index == 0 else ""
        else:
            text = self._buffer if self._index < 0 else ""
        self._buffer = ""
        return ParsedDelta(content=text)

    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        # Content is the text before the first call; what stands between and
        # after calls is dropped, as in the non-stream reply.
        if self._index < 0:
            out.content += text

    def _open_block(self) -> None:
        self._in_block, self._name_sent, self._scanner, self._args_done = True, False, None, False
        self._index += 1

    def _advance_block(self, out: ParsedDelta) -> bool:
        """Consume block text; True when the block closed and parsing continues."""
        if not self._name_sent:
            head = _HEAD.match(self._buffer)
            end = self._buffer.find(END)
            if head is None:
                if end < 0:
                    return False
                return self._emit_whole_block(out, self._buffer[:end], end)
            name = json.loads(f'"{head.group(1)}"')
            out.tool_calls.append(ToolCallDelta(self._index, id=new_call_id(), name=name))
            self._name_sent = True
            self._scanner = JsonValueScanner()
            self._buffer = self._buffer[head.end():]
        if not self._args_done:
            if self._scanner.depth == 0:  # not started: the arguments text starts at its `{`
                self._buffer = self._buffer.lstrip()
            used = self._scanner.feed(self._buffer)
            if used:
                out.tool_calls.append(ToolCallDelta(self._index, arguments=self._buffer[:used]))
            self._buffer = self._buffer[used:]
            if not self._scanner.is_complete:
                return False
            self._args_done = True
        end = self._buffer.find(END)
        if end < 0:
            return False
        self._buffer = self._buffer[end + len(END):]
        self._in_block = False
        return True

    def _emit_whole_block(self, out: ParsedDelta, block: str, end: int) -> bool:
        try:
            obj = json.loads(block)
            name, arguments = str(obj["name"]), _arguments_text(obj.get("arguments", {}))
        except (ValueError, KeyError, TypeError):
            out.content += START + block + END  # not a call after all: keep the text
            self._index -= 1
        else:
            out.tool_calls.append(ToolCallDelta(self._index, id=new_call_id(), name=name))
            out.tool_calls.append(ToolCallDelta(self._index, arguments=arguments))
        self._buffer = self._buffer[end + len(END):]
        self._in_block = False
        return True
