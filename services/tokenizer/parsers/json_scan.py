"""Finds where a JSON value ends in a growing buffer, so its raw text can be
streamed as it arrives (tool-call arguments) and cut exactly at its end."""
from __future__ import annotations


class JsonValueScanner:
    """Feed characters of one JSON object or array; `is_complete` once it closes."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False
        self.is_complete = False
        self._started = False

    def feed(self, text: str) -> int:
        """Consume text; return how many characters belong to the value."""
        for i, ch in enumerate(text):
            if self.is_complete:
                return i
            if not self._started:
                if ch.isspace():
                    continue
                if ch not in "{[":
                    raise ValueError("expected a JSON object or array")
                self._started = True
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_complete = True
                    return i + 1
        return len(text)
