"""`<think>…</think>` reasoning, for DeepSeek-R1 and Qwen3.

Text before the first `</think>` is reasoning, text after it is content. A
leading `<think>` is dropped. R1's template opens `<think>` in the prompt, so
its output starts inside the reasoning; a block cut short (length stop before
`</think>`) stays reasoning. With thinking off, nothing is reasoning.
"""
from __future__ import annotations

from services.tokenizer.parsers.base import partial_marker_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    def __init__(self, enabled: bool = True):
        self.is_reasoning = enabled
        self._at_start = enabled
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Return (reasoning, content) that are safe to emit now."""
        if not self.is_reasoning:
            return "", text
        buffer = self._held + text
        self._held = ""
        if self._at_start:
            stripped = buffer.lstrip()
            if THINK_START.startswith(stripped) and stripped != THINK_START:
                self._held = buffer  # may still become "<think>"
                return "", ""
            if stripped.startswith(THINK_START):
                buffer = stripped[len(THINK_START):]
            self._at_start = False
        end = buffer.find(THINK_END)
        if end >= 0:
            self.is_reasoning = False
            return buffer[:end], buffer[end + len(THINK_END):]
        keep = partial_marker_suffix(buffer, (THINK_END,))
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], ""

    def flush(self) -> tuple[str, str]:
        """At the end, held text belongs to whichever part we are in."""
        held, self._held = self._held, ""
        return (held, "") if self.is_reasoning else ("", held)


def split_reasoning(text: str, enabled: bool = True) -> tuple[str | None, str]:
    """Non-stream: (reasoning_content or None when the parser did not run, content)."""
    if not enabled:
        return None, text
    parser = ReasoningParser(enabled)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.flush()
    return reasoning + more_reasoning, content + more_content
