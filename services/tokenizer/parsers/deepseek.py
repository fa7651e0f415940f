"""DeepSeek-V3 / R1 tool calls.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

and the V3.1 form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.
Content is the text before the section. Streaming: the first delta of a call
carries id and name once its line is complete; ARGS streams as it arrives,
holding back what may be the closing fence.
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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = re.compile(r"\s*```(?:json)?\s*\n")
_FENCE_CLOSE = "\n```"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)


def _split_call(head: str, body: str) -> tuple[str, str]:
    """(name, arguments) of one call in either form."""
    if head.strip() == "function":  # V3 / R1: NAME on the first line, then a fenced block
        name, _, rest = body.partition("\n")
        fence = _FENCE_OPEN.match(rest)
        args = rest[fence.end():] if fence else rest
        if args.rstrip().endswith("```"):
            args = args.rstrip()[:-3]
        return name.strip(), args.strip()
    return head.strip(), body.strip()  # V3.1


def parse_complete(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find(CALLS_BEGIN)
    if start < 0:
        start = text.find(CALL_BEGIN)
    if start < 0:
        return text, []
    calls = []
    for head, body in _CALL.findall(text[start:]):
        name, args = _split_call(head, body)
        try:
            json.loads(args)
        except ValueError:
            return text, []
        calls.append(ToolCall(new_call_id(), name, args))
    if not calls:
        return text, []
    return text[:start], calls


class DeepSeekToolParser:
    def __init__(self) -> None:
        self._buffer = ""
        # content -> section -> head -> [fence] -> args -> [close] -> section ...
        self._state = "content"
        self._index = -1
        self._terminator = CALL_END

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def flush(self) -> ParsedDelta:
        text = self._buffer if self._state == "content" else ""
        self._buffer = ""
        return ParsedDelta(content=text)

    def _step(self, out: ParsedDelta) -> bool:
        """Advance one state; False when more text is needed."""
        buf = self._buffer
        if self._state == "content":
            starts = [i for i in (buf.find(CALLS_BEGIN), buf.find(CALL_BEGIN)) if i >= 0]
            if not starts:
                keep = partial_marker_suffix(buf, (CALLS_BEGIN, CALL_BEGIN))
                out.content += buf[: len(buf) - keep]
                self._buffer = buf[len(buf) - keep:]
                return False
            out.content += buf[: min(starts)]
            return self._goto("section", buf[min(starts):])
        if self._state == "section":
            stripped = buf.lstrip()
            for marker in (CALLS_BEGIN, CALLS_END):
                if stripped.startswith(marker):
                    return self._goto("section", stripped[len(marker):])
            if stripped.startswith(CALL_BEGIN):
                return self._goto("head", stripped[len(CALL_BEGIN):])
            return False  # a partial marker: wait
        if self._state == "head":
            sep = buf.find(SEP)
            if sep < 0:
                return False
            head, rest = buf[:sep].strip(), buf[sep + len(SEP):]
            if head != "function":  # V3.1: NAME<sep>ARGS<call end>
                self._open_call(out, head)
                self._terminator = CALL_END
                return self._goto("args", rest)
            line_end = rest.find("\n")
            if line_end < 0:
                return False
            self._open_call(out, rest[:line_end].strip())
            self._terminator = _FENCE_CLOSE
            return self._goto("fence", rest[line_end + 1:])
        if self._state == "fence":
            if "\n" not in buf and len(buf) < 16:
                return False
            fence = _FENCE_OPEN.match(buf)
            return self._goto("args", buf[fence.end():] if fence else buf)
        if self._state == "args":
            end = buf.find(self._terminator)
            if end < 0:
                keep = partial_marker_suffix(buf, (self._terminator,))
                self._emit_args(out, buf[: len(buf) - keep])
                self._buffer = buf[len(buf) - keep:]
                return False
            self._emit_args(out, buf[:end])
            rest = buf[end + len(self._terminator):]
            return self._goto("section" if self._terminator == CALL_END else "close", rest)
        # close: skip to the end of the call
        close = buf.find(CALL_END)
        if close < 0:
            return False
        return self._goto("section", buf[close + len(CALL_END):])

    def _goto(self, state: str, buffer: str) -> bool:
        self._state, self._buffer = state, buffer
        return True

    def _open_call(self, out: ParsedDelta, name: str) -> None:
        self._index += 1
        out.tool_calls.append(ToolCallDelta(self._index, id=new_call_id(), name=name))

    def _emit_args(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=text))
