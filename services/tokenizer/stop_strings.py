"""Stop strings over streamed text: a stop string split across tokens is still
found, and text that might be the start of one is held back until it is known
not to be."""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str], include_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self._held = ""
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit now; sets `is_stopped` on a match."""
        if self.is_stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        match = min(
            ((buffer.find(s), s) for s in self.stops if s in buffer),
            default=None,
            key=lambda m: m[0],
        )
        if match is not None:
            index, stop = match
            self.is_stopped = True
            self._held = ""
            return buffer[: index + len(stop)] if self.include_in_output else buffer[:index]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation the held text is final output."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _longest_partial_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if stop.startswith(buffer[-length:]):
                    best = length
                    break
        return best
