"""ChatGLM3 function calls: the reply's first line is the function name (an
ordinary reply starts with an empty line), then a fenced python block holding
`tool_call(key=value, ...)`.

The keyword values are read with `ast.literal_eval` (never `eval`). The format
only shows it is a call once the whole block is there, so streaming emits the
call at the end; ordinary replies stream as content.
"""
from __future__ import annotations

import ast
import json

from services.tokenizer.parsers.base import ParsedDelta, ToolCall, ToolCallDelta, new_call_id


def _parse_call(text: str) -> ToolCall | None:
    name, _, body = text.partition("\n")
    name = name.strip()
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        return None
    lines = [line for line in body.strip().splitlines()]
    if lines and lines[0].startswith("```"):
        lines = lines[1:]
    if lines and lines[-1].strip() == "```":
        lines = lines[:-1]
    try:
        call = ast.parse("\n".join(lines).strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"):
            return None
        if call.args:
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    except (SyntaxError, ValueError):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def parse_complete(text: str) -> tuple[str, list[ToolCall]]:
    call = _parse_call(text)
    if call is None:
        return text.lstrip("\n"), []
    return "", [call]


class Glm3ToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "undecided"  # -> content | call

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta(content=text)
        self._buffer += text
        if self._mode == "undecided":
            if "\n" not in self._buffer:
                return ParsedDelta()
            first_line, _, rest = self._buffer.partition("\n")
            if first_line.strip():
                self._mode = "call"
                return ParsedDelta()
            self._mode, self._buffer = "content", ""
            return ParsedDelta(content=rest)
        return ParsedDelta()

    def flush(self) -> ParsedDelta:
        text, self._buffer = self._buffer, ""
        if self._mode == "content" or not text:
            return ParsedDelta()
        call = _parse_call(text)
        if call is None:
            return ParsedDelta(content=text)
        return ParsedDelta(tool_calls=[ToolCallDelta(0, id=call.id, name=call.name),
                                       ToolCallDelta(0, arguments=call.arguments)])
