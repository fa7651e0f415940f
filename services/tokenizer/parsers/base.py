"""What every output parser shares: the deltas they emit, call ids, and the
hold-back of text that may be the start of a marker."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` plus 8 alphanumerics, as the reference emits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call: the first carries id and name, later
    ones append to the arguments (OpenAI stream shape)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one feed produced: plain content and/or tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass(frozen=True)
class ToolCall:
    """A complete call (non-stream replies)."""

    id: str
    name: str
    arguments: str


def partial_marker_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker:
    that text must be held back until the next piece shows what it is."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-length:]):
                best = length
                break
    return best


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Fold streamed deltas into complete calls (what a client does)."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        if d.id:
            call["id"] = d.id
        if d.name:
            call["name"] = d.name
        call["arguments"] += d.arguments
    return [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
